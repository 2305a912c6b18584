"""Build the model a recipe names: a preset with random weights, or a local Hugging Face directory.

Weights are created where they will live: directly on the training device, or partitioned by
DeepSpeed's `zero.Init` under ZeRO-3 (transformers enters it when an `HfDeepSpeedConfig` is alive),
so a 7B preset starts in seconds instead of minutes of CPU initialisation. With `model.quantize`
the linear layers are quantised as they are created (`memtrain.model.quantize`).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from memtrain.dtypes import DTYPES
from memtrain.errors import Problem, UserError
from memtrain.hub import model_dir
from memtrain.model.config import model_config
from memtrain.model.layers import decoder_layers
from memtrain.model.lora_dropout import use_lean_dropout
from memtrain.model.peft_quiet import peft_quietly
from memtrain.model.quantize import bnb_config, keep_training_layout, quantized_preset, require_bitsandbytes
from memtrain.recipe.schema import ALL_LINEAR, Lora, Model


def build_model(
    model: Model,
    compute: str,
    device: torch.device,
    ds_config: dict | None = None,
    seed: int = 0,
    vocab_size: int | None = None,
) -> PreTrainedModel:
    """The causal LM in the compute dtype, with LoRA adapters when the recipe asks for them.

    ds_config: the compiled DeepSpeed config; with ZeRO-3 the weights are partitioned as they are built.
    vocab_size: grow the embeddings (and an untied head) to this many rows, for tokens added to the
    tokenizer (a chat template's markers); the new rows are trained.
    """
    dtype = DTYPES[compute]
    zero3 = ds_config is not None and ds_config.get("zero_optimization", {}).get("stage") == 3
    keep_alive = None
    if zero3:
        from transformers.integrations import HfDeepSpeedConfig

        keep_alive = HfDeepSpeedConfig(ds_config)  # noqa: F841 — transformers reads it while it lives
    torch.manual_seed(seed)
    config = model_config(model)
    quantization = {}
    if model.quant_type:
        require_bitsandbytes()
        quantization = {"quantization_config": bnb_config(model.quantize, dtype)}
    if model.preset and model.quant_type:
        lm = quantized_preset(config, model.quantize, dtype, device)
    elif model.preset:
        place = nullcontext() if zero3 else torch.device(device)
        with place:
            lm = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        try:
            lm = AutoModelForCausalLM.from_pretrained(
                model_dir(model.path, model.revision),
                config=config,
                dtype=dtype,
                local_files_only=True,
                low_cpu_mem_usage=True,
                device_map=None if zero3 else {"": device},
                **quantization,
            )
        except (OSError, ValueError) as error:
            raise UserError(
                Problem(
                    f"cannot load the model from '{model.path}': {error}",
                    key="model.path",
                    hint="give a directory written by save_pretrained (config.json + weights)",
                )
            ) from None
    lm.config.use_cache = False
    if vocab_size is not None and vocab_size > lm.get_input_embeddings().num_embeddings:
        lm.resize_token_embeddings(vocab_size)
    if model.quant_type:
        keep_training_layout(lm)
    if model.lora is not None:
        lm = add_lora(lm, model)
    del keep_alive
    return lm


def lora_targets(lora: Lora) -> list[str] | str:
    """What PEFT's LoraConfig takes: the recipe's list, or the string 'all-linear'."""
    return ALL_LINEAR if lora.target_modules == ALL_LINEAR else list(lora.target_modules)


def lora_config(lora: Lora):
    """PEFT's LoraConfig for a recipe's `model.lora` (one owner: the model build and the planner's traced layer).

    LoRA+ is not here: it is an optimizer setting (memtrain.model.loraplus.lora_param_groups).
    """
    from peft import LoraConfig

    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora_targets(lora),
        task_type="CAUSAL_LM",
        use_dora=lora.use_dora,
        use_rslora=lora.use_rslora,
        modules_to_save=list(lora.modules_to_save) or None,
    )


def add_lora(lm: PreTrainedModel, model: Model) -> torch.nn.Module:
    """Wrap the model with PEFT LoRA adapters; only the adapters (and `modules_to_save`) train."""
    from peft import get_peft_model

    lora = model.lora
    present = {name.rsplit(".", 1)[-1] for name, _ in lm.named_modules()}
    missing = [t for t in lora.target_modules if t not in present] if lora.target_modules != ALL_LINEAR else []
    if missing:
        raise UserError(
            Problem(
                f"LoRA target modules {missing} are not in this model",
                key="model.lora.target_modules",
                hint="modules it has include: "
                f"{', '.join(sorted(n for n in present if n.endswith('proj'))) or 'see model.named_modules()'}",
            )
        )
    unsaved = [m for m in lora.modules_to_save if m not in present]
    if unsaved:
        layers_name, _ = decoder_layers(lm)
        outside = sorted(
            {
                name.rsplit(".", 1)[-1]
                for name, module in lm.named_modules()
                if name
                and not name.startswith(layers_name)
                and next(module.parameters(recurse=False), None) is not None
            }
        )
        raise UserError(
            Problem(
                f"modules_to_save {unsaved} are not in this model",
                key="model.lora.modules_to_save",
                hint=f"modules outside the decoder layers are: {', '.join(outside)}",
            )
        )
    # Not PEFT's prepare_model_for_kbit_training: its fp32 upcast of the unquantised weights would be
    # undone by DeepSpeed's bf16 engine (fp32_modules is the recipe's way to keep modules in fp32), and
    # checkpointing is memtrain's own; what it does that matters here is the input-grad hook below.
    with peft_quietly():
        peft_model = get_peft_model(lm, lora_config(lora))
    if lora.lean_dropout and lora.dropout > 0:
        use_lean_dropout(peft_model)
    if hasattr(peft_model, "enable_input_require_grads"):
        # checkpointed layers need an input that requires grad when the embeddings are frozen
        peft_model.enable_input_require_grads()
    return peft_model
