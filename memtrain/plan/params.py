"""Parameter counts of a recipe's model, by trainability, from the model built on the meta device."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from memtrain.model.config import meta_model
from memtrain.model.layers import decoder_layers
from memtrain.model.quantize import quantized_linear_names
from memtrain.plan.quantized import quantized_weight_bytes
from memtrain.recipe.schema import ALL_LINEAR, Model


@dataclass(frozen=True)
class ParamCounts:
    """Element counts (not bytes) of the model's parameters."""

    total: int  # every parameter, LoRA adapters included
    trainable: int  # what gets gradients and optimizer states (all weights, or the LoRA adapters)
    largest_layer: int  # one decoder layer (ZeRO-3 gathers a layer at a time)
    largest_tensor: int  # the biggest single tensor (embedding / lm_head: ZeRO-3 gathers it whole)
    num_layers: int
    hidden_size: int
    vocab_size: int
    layers_name: str = "model.layers"  # dotted name of the decoder layer list (checkpoint rules match on it)
    quantized: int = 0  # elements stored quantised (model.quantize), part of `total`
    quantized_bytes: int = 0  # their bytes, quantisation constants included
    trainable_numels: tuple[int, ...] = ()  # elements of each trainable tensor (per-tensor host buffers)
    tensor_numels: tuple[int, ...] = ()  # elements of every parameter tensor of the base model

    @property
    def frozen(self) -> int:
        return self.total - self.trainable

    def weight_bytes(self, dtype_bytes: int) -> int:
        """Bytes of every parameter: quantised weights at their packed size, the rest at `dtype_bytes` each."""
        return (self.total - self.quantized) * dtype_bytes + self.quantized_bytes


def _lora_targets(name: str, targets: list[str] | str, head: str = "") -> bool:
    """PEFT's rule for a string list: the module's name equals a target or ends with '.target';
    'all-linear': every linear layer but the output head (`head`, its name)."""
    if targets == ALL_LINEAR:
        return name != head
    return any(name == t or name.endswith("." + t) for t in targets)


def count_parameters(model: Model) -> ParamCounts:
    """Count the recipe's parameters on the meta device; LoRA adds r × (in + out) per targeted Linear,
    plus out for DoRA's magnitude, and a trainable copy of each of `modules_to_save`.

    LoRA adapters are counted from the target modules' shapes, the same rule PEFT applies; the base
    weights are frozen, so only the adapters are trainable. With model.quantize, the linear layers
    the model build quantises (`quantized_linear_names`) are counted at their quantised bytes.
    """
    return _count(model.model_dump_json())


@lru_cache(maxsize=32)
def _count(model_json: str) -> ParamCounts:
    model = Model.model_validate_json(model_json)
    module = meta_model(model)
    config = module.config
    base_total = sum(p.numel() for p in module.parameters())
    largest_tensor = max(p.numel() for p in module.parameters())
    layers_name, layers = decoder_layers(module)
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    trainable = base_total
    trainable_numels = tensor_numels = tuple(p.numel() for p in module.parameters())
    if model.lora is not None:
        lora = model.lora
        adapters = 0
        adapter_per_layer = 0
        lora_numels: list[int] = []
        output = module.get_output_embeddings()
        head = next((name for name, sub in module.named_modules() if sub is output), "")
        for name, sub in module.named_modules():
            numels: list[int] = []
            if isinstance(sub, torch.nn.Linear) and _lora_targets(name, lora.target_modules, head):
                numels = [lora.r * sub.in_features, lora.r * sub.out_features]
                if lora.use_dora:  # DoRA also trains a magnitude per output feature
                    numels.append(sub.out_features)
            elif _lora_targets(name, lora.modules_to_save):  # PEFT trains a full copy beside the frozen original
                numels = [p.numel() for p in sub.parameters()]
            adapters += sum(numels)
            lora_numels += numels
            if name.startswith(layers_name + ".0."):
                adapter_per_layer += sum(numels)
        trainable = adapters
        trainable_numels = tuple(lora_numels)
        base_total += adapters
        per_layer = [n + adapter_per_layer for n in per_layer]
    quantized, quantized_bytes = _quantized(module, model)
    return ParamCounts(
        total=base_total,
        trainable=trainable,
        largest_layer=max(per_layer),
        largest_tensor=largest_tensor,
        num_layers=len(layers),
        hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
        layers_name=layers_name,
        quantized=quantized,
        quantized_bytes=quantized_bytes,
        trainable_numels=trainable_numels,
        tensor_numels=tensor_numels,
    )


def _quantized(module: torch.nn.Module, model: Model) -> tuple[int, int]:
    """(elements, bytes) of the weights stored quantised; (0, 0) without model.quantize."""
    if not model.quant_type:
        return 0, 0

    modules = dict(module.named_modules())
    elements = size_bytes = 0
    for name in quantized_linear_names(module):
        weight = modules[name].weight
        elements += weight.numel()
        size_bytes += quantized_weight_bytes(
            weight.numel(), weight.shape[0], model.quant_type, model.quantize.double_quant
        )
    return elements, size_bytes
