"""Quantised base weights (QLoRA) through bitsandbytes: which layers, and how a model gets them.

Which layers: every plain nn.Linear except the ones transformers keeps unquantised (the output head,
tied weights, the last parameter), decided with transformers' own `get_keys_to_not_convert` and
`should_convert_module`, so a preset quantises exactly what `from_pretrained` with a
`BitsAndBytesConfig` would. The planner counts the same list (`quantized_linear_names`).

How: a local directory loads with `from_pretrained(quantization_config=...)`. A preset has no
weights to load, so it is built on the meta device and materialised one module at a time on the
training device, each nn.Linear initialised in the compute dtype and replaced at once by its
bitsandbytes layer: the full-precision model never exists (a 13B preset peaks at its 4-bit size
plus one bf16 matrix, not the 26 GB of its bf16 weights).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from memtrain.errors import Problem, UserError
from memtrain.recipe.schema import Quantize


def require_bitsandbytes() -> None:
    """Raise a UserError saying how to install bitsandbytes when it is missing."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as error:
        raise UserError(
            Problem(
                f"quantised weights and 8-bit / paged optimizers need bitsandbytes ({error})",
                key="model.quantize",
                hint="pip install 'memtrain[qlora]' (bitsandbytes)",
            )
        ) from None


def quantized_linear_names(lm: nn.Module) -> list[str]:
    """Dotted names of the nn.Linear modules transformers would quantise (works on meta models)."""
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    keep = get_keys_to_not_convert(lm)
    return [
        name for name, module in lm.named_modules() if type(module) is nn.Linear and should_convert_module(name, keep)
    ]


def bnb_config(quantize: Quantize, compute_dtype: torch.dtype):
    """The transformers BitsAndBytesConfig of a recipe's quantize section (for from_pretrained)."""
    from transformers import BitsAndBytesConfig

    if quantize.type == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quantize.type,
        bnb_4bit_use_double_quant=quantize.double_quant,
        bnb_4bit_compute_dtype=compute_dtype,
    )


def quantized_linear(
    linear: nn.Linear, quantize: Quantize, compute_dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """A frozen bitsandbytes layer holding `linear`'s weights quantised on `device`."""
    import bitsandbytes as bnb

    with torch.device("meta"):  # the layer's own weight is replaced below; allocate nothing for it
        if quantize.type == "int8":
            layer = bnb.nn.Linear8bitLt(
                linear.in_features, linear.out_features, linear.bias is not None, has_fp16_weights=False
            )
        else:
            layer = bnb.nn.Linear4bit(
                linear.in_features,
                linear.out_features,
                linear.bias is not None,
                compute_dtype=compute_dtype,
                compress_statistics=quantize.double_quant,
                quant_type=quantize.type,
            )
    weight = linear.weight.data
    if quantize.type == "int8":
        # Int8Params quantises when it moves from the CPU to the device
        layer.weight = bnb.nn.Int8Params(weight.cpu(), requires_grad=False, has_fp16_weights=False).to(device)
    else:
        layer.weight = bnb.nn.Params4bit(
            weight,
            requires_grad=False,
            compress_statistics=quantize.double_quant,
            quant_type=quantize.type,
            module=layer,
        ).to(device)
    if linear.bias is not None:
        layer.bias = nn.Parameter(linear.bias.data.to(device), requires_grad=False)
    return layer


def keep_training_layout(lm: nn.Module) -> None:
    """Stop bitsandbytes repacking 4-bit weights for CPU inference on the first eval forward.

    On a CPU with AVX512-BF16, Linear4bit rewrites its weight and quant_state in place into an
    inference-only layout the first time it runs without grad (and asserts on output widths not
    divisible by 32). memtrain alternates training and evaluation on the same weights, so it keeps
    the one layout they share. No effect on CUDA.
    """
    for module in lm.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def quantized_preset(
    config: PretrainedConfig, quantize: Quantize, dtype: torch.dtype, device: torch.device
) -> PreTrainedModel:
    """A preset with random weights, its linear layers quantised as they are materialised on `device`.

    Initialised with the model's own `_init_weights` (the preset's usual distributions), in the
    post-order transformers uses; the random draws are not those of the unquantised preset at the
    same seed (that one draws torch's default init first), but are reproducible for a seed.
    """
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config, dtype=dtype)
    targets = set(quantized_linear_names(lm))
    with torch.no_grad():
        _materialise(lm, "", lm._initialize_weights, targets, quantize, dtype, torch.device(device))
    lm.tie_weights()
    return lm


def _materialise(
    module: nn.Module,
    prefix: str,
    init,
    targets: set[str],
    quantize: Quantize,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Children first, then the module itself (transformers' initialisation order)."""
    for name, child in list(module.named_children()):
        full_name = f"{prefix}.{name}" if prefix else name
        child_init = child._initialize_weights if isinstance(child, PreTrainedModel) else init
        _materialise(child, full_name, child_init, targets, quantize, dtype, device)
        if full_name in targets:
            setattr(module, name, quantized_linear(child, quantize, dtype, device))
    module.to_empty(device=device, recurse=False)
    init(module)


def quantized_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every tensor that stores quantised weights: packed data and quantisation constants, each storage once."""
    tensors: dict[int, torch.Tensor] = {}
    for param in module.parameters():
        parts = []
        state = getattr(param, "quant_state", None)
        if state is not None:  # 4-bit: packed data, absmax, code table; nested: offset + second-level state
            parts += [param.data, state.absmax, state.code]
            if state.nested:
                parts += [state.offset, state.state2.absmax, state.state2.code]
        elif param.dtype == torch.int8:  # LLM.int8: int8 rows + one fp32 scale per row
            parts += [param.data, getattr(param, "SCB", None)]
        for tensor in parts:
            if tensor is not None:
                tensors.setdefault(tensor.untyped_storage().data_ptr(), tensor)
    return list(tensors.values())


def quantized_bytes(module: nn.Module) -> int:
    """Bytes of the quantised weights as they lie in memory (data + constants), for tests and reports."""
    return sum(t.untyped_storage().nbytes() for t in quantized_tensors(module))
