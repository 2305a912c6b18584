"""Per-module precision: the model in the compute dtype, with fp32 islands named by globs.

DeepSpeed's bf16/fp16 blocks handle the engine (master weights, loss scaling); what they cannot
express is "these modules compute in fp32", so that is done here with forward wrappers: an island
casts its floating inputs to fp32, computes in fp32, and hands its output back in the compute dtype
(the model's output embeddings excepted: their fp32 logits go straight into the fp32 loss).

Note: a DeepSpeed engine with bf16/fp16 enabled casts every parameter to that dtype in
`deepspeed.initialize`. The islands still compute in fp32 then (their weights are upcast inside the
forward, and gradients flow back to the low-precision copies and DeepSpeed's fp32 masters).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from memtrain.dtypes import DTYPES
from memtrain.errors import Problem, RecipeError
from memtrain.model.layers import hf_model
from memtrain.model.recompute import name_matches
from memtrain.recipe.schema import Precision


def compute_dtype(precision: Precision) -> torch.dtype:
    """The torch dtype of the recipe's compute precision."""
    return DTYPES[precision.compute]


def storage_dtype(precision: Precision) -> torch.dtype:
    """The dtype weights are stored in: the compute dtype, or fp32 under precision.mode autocast."""
    return DTYPES[precision.storage]


def fp32_island_names(model: nn.Module, globs: list[str]) -> list[str]:
    """Outermost module names (PEFT wrapper removed) matched by the fp32_modules globs.

    Raises RecipeError naming each glob that matches nothing (almost always a typo).
    """
    names = [n for n, _ in hf_model(model).named_modules() if n]
    islands: list[str] = []
    used: set[str] = set()
    for name in names:
        hits = [g for g in globs if name_matches(name, g)]
        used.update(hits)
        if hits and not any(name.startswith(i + ".") for i in islands):
            islands.append(name)
    unused = [g for g in globs if g not in used]
    if unused:
        raise RecipeError(
            [
                Problem(
                    f"fp32_modules pattern '{g}' matches no module",
                    key="precision.fp32_modules",
                    hint=f"module names look like {', '.join(names[:6])}",
                )
                for g in unused
            ]
        )
    return islands


def _cast_floating(value, dtype: torch.dtype):
    """`value` with every floating tensor inside (nested tuples/lists/dicts) cast to `dtype`."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floating(v, dtype) for k, v in value.items()}
    if hasattr(value, "to_tuple") and hasattr(value, "keys"):  # transformers ModelOutput
        for key in list(value.keys()):
            value[key] = _cast_floating(value[key], dtype)
        return value
    return value


def _upcast_own_parameters(module: nn.Module) -> None:
    """Make the module's own parameters fp32 for the duration of its forward (a no-op when they are).

    The parameters are swapped for autograd-tracked fp32 copies only inside forward, which runs
    after ZeRO-3's gather hooks, so the copies are of the gathered weights and gradients reach them.
    """
    original = module.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        low = {
            n: p
            for n, p in module._parameters.items()
            if p is not None and p.is_floating_point() and p.dtype != torch.float32
        }
        if not low:
            return original(*args, **kwargs)
        try:
            for n, p in low.items():
                module._parameters[n] = p.float()
            return original(*args, **kwargs)
        finally:
            module._parameters.update(low)

    module.forward = forward


def _island_boundary(module: nn.Module, output_dtype: torch.dtype | None) -> None:
    """Inputs cast to fp32 on entry; the output cast to `output_dtype` on exit (None: left fp32)."""
    original = module.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            # Autocast would silently push the island's matmuls back to low precision.
            for device_type in ("cuda", "cpu"):
                if torch.is_autocast_enabled(device_type):
                    stack.enter_context(torch.autocast(device_type=device_type, enabled=False))
            out = original(*_cast_floating(args, torch.float32), **_cast_floating(kwargs, torch.float32))
        return out if output_dtype is None else _cast_floating(out, output_dtype)

    module.forward = forward


def apply_precision(model: nn.Module, precision: Precision) -> list[str]:
    """Cast the model's parameters to the compute dtype and keep `fp32_modules` as fp32 islands.

    Buffers keep their dtype (rotary frequencies must stay fp32), as DeepSpeed does. Returns the
    island names. Call after `apply_checkpointing` and before `deepspeed.initialize`.
    """
    dtype = compute_dtype(precision)
    base = hf_model(model)
    islands = fp32_island_names(model, precision.fp32_modules)
    storage = storage_dtype(precision)
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != storage:
            p.data = p.data.to(storage)
    modules = dict(base.named_modules())
    logits_module = base.get_output_embeddings()
    for name in islands:
        island = modules[name]
        for sub in island.modules():
            for p in sub.parameters(recurse=False):
                if p.is_floating_point():  # quantised weights (uint8 / int8) keep their packed storage
                    p.data = p.data.float()
            if any(True for _ in sub.parameters(recurse=False)):
                _upcast_own_parameters(sub)
        _island_boundary(island, None if island is logits_module else dtype)
    return islands
