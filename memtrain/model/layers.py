"""Where a causal LM keeps its decoder layers: the one answer checkpointing, compilation, OOM hooks and the planner share."""
from __future__ import annotations

from torch import nn

from memtrain.errors import Problem, RecipeError


def hf_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model under a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(dotted name, list) of the decoder layers: the longest non-empty nn.ModuleList of the model
    (model.layers for Llama, transformer.h for GPT-2), under a PEFT wrapper too."""
    best: tuple[str, nn.ModuleList] | None = None
    for name, module in hf_model(model).named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and (best is None or len(module) > len(best[1])):
            best = (name, module)
    if best is None:
        raise RecipeError(Problem(f"cannot find the decoder layers of {type(model).__name__}",
                                  key="checkpointing.strategy",
                                  hint="use strategy 'none' or 'rules' naming its blocks"))
    return best


def decoder_layer_names(model: nn.Module) -> list[str]:
    """Dotted names of the decoder layers, first to last."""
    name, layers = decoder_layers(model)
    return [f"{name}.{i}" for i in range(len(layers))]
