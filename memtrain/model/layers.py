"""Where a Hugging Face causal LM keeps its decoder layers, found from the model itself, not from Llama names.

One finder for everything that works layer by layer: activation checkpointing, regional compilation,
the memory planner (per-layer parameters, the traced layer) and the OOM injector. Models name the list
differently (`model.layers` in Llama, Qwen, Mistral, Gemma and Phi-3; `transformer.h` in GPT-2;
`gpt_neox.layers`), so the list is recognised by what it holds: instances of the classes the model
declares as its unsplittable blocks (`_no_split_modules`, which transformers keeps for device maps
and which names exactly the decoder layer class). "The longest ModuleList" is only the fallback: in a
mixture-of-experts model under transformers 4.x the experts of one layer sit in a ModuleList (60 in
Qwen2-MoE) that outnumbers its 24 layers.
"""

from __future__ import annotations

from torch import nn

from memtrain.errors import Problem, UserError


def hf_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model under a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(dotted name relative to the Hugging Face model, the list) of the decoder layers.

    Works on PEFT-wrapped, meta-device and ZeRO-3-partitioned models alike (it reads the module tree
    only). Raises UserError when the model has no non-empty ModuleList at all.
    """
    base = hf_model(model)
    lists = [(name, m) for name, m in base.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    block_classes = set(getattr(base, "_no_split_modules", None) or ())
    blocks = [(name, m) for name, m in lists if type(m[0]).__name__ in block_classes]
    candidates = blocks or lists
    if not candidates:
        raise UserError(
            Problem(
                f"cannot find the decoder layers of {type(base).__name__}: it has no list of layer modules",
                key="model",
                hint="memtrain trains transformer causal LMs whose layers sit in an nn.ModuleList "
                "(model.layers, transformer.h); use checkpointing.strategy 'none' or 'rules' naming its blocks",
            )
        )
    return max(candidates, key=lambda item: len(item[1]))


def decoder_layer_names(model: nn.Module) -> list[str]:
    """Dotted names of the decoder layers, first to last ('model.layers.0', ...)."""
    name, layers = decoder_layers(model)
    return [f"{name}.{i}" for i in range(len(layers))]
