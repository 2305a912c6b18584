"""Settings of PyTorch's memory allocators, applied once per process before anything is allocated.

Expandable segments (PyTorch's `expandable_segments:True`): instead of caching fixed-size blocks,
the CUDA allocator maps physical pages into one growing virtual range per stream, so memory freed by
one phase (deepspeed.initialize's flat copy of the parameters, a layer's activations) is reused by
the next whatever the sizes. Reserved memory then tracks allocated memory closely: the planner's
peak is the allocated peak plus a small, stable margin (plan/calibration.py), and a recipe does not
run out of memory with gigabytes reserved but unused.

Pinned host memory (DeepSpeed pins an offloaded optimizer's fp32 weights and gradients, and ZeRO-3's parameter
partitions, while the run starts): by default PyTorch takes each buffer with one cudaHostAlloc, whose one thread
faults in every page. With `pinned_use_cuda_host_register` it allocates ordinary memory, faults it in from several
threads and registers it with CUDA: 4 GiB pinned in 0.57 s instead of 2.96 on the GPU machine (16 threads,
benchmarks/pinned.csv), the same buffers, the same copy speed. Not under WSL: there the driver registers host
memory from a page-locking pool of about half the RAM (and GPU-offload recipes there are not measured), so
memtrain leaves PyTorch's default.
"""

from __future__ import annotations

import os
import platform
from functools import lru_cache

import torch

from memtrain.plan.pinned import ROUND_THRESHOLD_BYTES
from memtrain.units import MiB

USER_SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
PINNED_SETTING_KEY = "pinned_max_round_threshold_mb"
MAX_PINNING_THREADS = 16  # measured: 8 threads 0.76 s, 16 threads 0.57 s for 4 GiB (benchmarks/pinned.csv)


def _current() -> str:
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    current = getter() if getter is not None else ""
    return ",".join([current or ""] + [os.environ.get(name, "") for name in USER_SETTINGS])


def set_allocator_setting(key: str, value: str) -> bool:
    """Add `key:value` to PyTorch's allocator settings unless the user already chose `key` (in
    PYTORCH_CUDA_ALLOC_CONF, say). Returns whether `key:value` is in force afterwards."""
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


@lru_cache(maxsize=1)
def exact_pinned_supported() -> bool:
    """Set PyTorch's pinned-memory rounding threshold for this process (before DeepSpeed pins anything)
    and say whether this PyTorch has it (2.13 does, 2.11 not): whether pinned buffers take their real
    size (memtrain.plan.pinned prices them the same way). Harmless before any pinning."""
    return set_allocator_setting(PINNED_SETTING_KEY, str(ROUND_THRESHOLD_BYTES // MiB))


def pinning_threads(usable_cpus: int) -> int:
    """Threads that fault in a pinned buffer's pages: the largest power of two (PyTorch's rule) within the
    cores this process may use, at most MAX_PINNING_THREADS."""
    threads = 1
    while threads * 2 <= min(usable_cpus, MAX_PINNING_THREADS):
        threads *= 2
    return threads


def under_wsl(kernel_release: str | None = None) -> bool:
    """Whether this Linux is Windows' WSL (its kernel release names Microsoft)."""
    release = platform.release() if kernel_release is None else kernel_release
    return "microsoft" in release.lower() or "wsl" in release.lower()


def use_parallel_pinning(usable_cpus: int, kernel_release: str | None = None) -> bool:
    """Pin host buffers by registering memory that several threads fault in (see the module's docstring), before
    anything is pinned; not under WSL. Returns whether it is in force (the user's PYTORCH_CUDA_ALLOC_CONF wins)."""
    if under_wsl(kernel_release) or not set_allocator_setting("pinned_use_cuda_host_register", "True"):
        return False
    set_allocator_setting("pinned_num_register_threads", str(pinning_threads(usable_cpus)))
    return True
