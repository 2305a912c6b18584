"""Settings of PyTorch's memory allocators, applied once per process before anything is allocated.

Expandable segments (PyTorch's `expandable_segments:True`): instead of caching fixed-size blocks,
the CUDA allocator maps physical pages into one growing virtual range per stream, so memory freed by
one phase (deepspeed.initialize's flat copy of the parameters, a layer's activations) is reused by
the next whatever the sizes. Reserved memory then tracks allocated memory closely: the planner's
peak is the allocated peak plus a small, stable margin (plan/calibration.py), and a recipe does not
run out of memory with gigabytes reserved but unused.
"""
from __future__ import annotations

import os

USER_SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def _current() -> str:
    import torch

    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    current = getter() if getter is not None else ""
    return ",".join([current or ""] + [os.environ.get(name, "") for name in USER_SETTINGS])


def set_allocator_setting(key: str, value: str) -> bool:
    """Add `key:value` to PyTorch's allocator settings unless the user already chose `key` (in
    PYTORCH_CUDA_ALLOC_CONF, say). Returns whether `key:value` is in force afterwards."""
    import torch

    current = _current().replace(" ", "")
    if f"{key}:" in current:
        return f"{key}:{value}".lower() in current.lower()
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    try:
        if setter is None:
            torch.cuda.memory._set_allocator_settings(f"{key}:{value}")
        else:
            setter(f"{key}:{value}")
    except (RuntimeError, ValueError, AttributeError):  # a PyTorch that does not know the key
        return False
    return True


def use_expandable_segments(enabled: bool) -> bool:
    """Turn PyTorch's expandable CUDA segments on or off for this process, before its first CUDA
    allocation. Returns whether they are on (the user's PYTORCH_CUDA_ALLOC_CONF wins)."""
    in_force = set_allocator_setting("expandable_segments", "True" if enabled else "False")
    return in_force if enabled else not in_force
