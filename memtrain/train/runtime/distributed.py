"""Process setup: rank environment, device, GPU memory cap, DeepSpeed's process group."""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from memtrain.configs import GpuProfile, allocator_budget_bytes, gpu_profile
from memtrain.train.ops.locks import clear_stale_locks
from memtrain.train.runtime.allocator import exact_pinned_supported, use_expandable_segments, use_parallel_pinning


@dataclass(frozen=True)
class Place:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    node_rank: int = 0  # torchrun's GROUP_RANK: which machine of a multi-node run

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    @classmethod
    def single(cls, device: torch.device) -> "Place":
        """One process alone on `device` (scoring a finished run, a benchmark)."""
        return cls(rank=0, local_rank=0, world_size=1, device=device)


# What a launcher (torchrun, or setup_process for a process started alone) sets for one process of a group. A
# process started from such a process (a benchmark's `memtrain run`, a test's) must not inherit them: it would
# try to join, or bind again, its parent's group.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def without_rank_variables(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a child process that starts its own process group."""
    return {key: value for key, value in env.items() if key not in RANK_VARIABLES}


def usable_cpus() -> int:
    """The cores this process may run on: its affinity set, cut to the cgroup's CPU quota where one is set.

    os.cpu_count() counts the host's cores; in a container limited by a quota it can say 64 where 2 may
    run, and threads sized to it spin against each other."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota()
    return max(1, min(cores, math.ceil(quota)) if quota else cores)


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """Cores' worth of CPU time the cgroup allows (v2 cpu.max, else v1 cfs_quota_us), None when unlimited."""
    v2, v1 = root / "cpu.max", root / "cpu"
    try:
        quota, period = v2.read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota, period = ((v1 / name).read_text().strip() for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
        except OSError:
            return None
    if quota in ("max", "-1"):
        return None
    return int(quota) / int(period)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def setup_process(gpu: str, cap_memory: bool, expandable_segments: bool = True) -> tuple[Place, int]:
    """Join (or, alone, create) the process group; pick the device; set the allocators up (expandable
    CUDA segments, pinned sizes, pinning threads); cap GPU memory to the target card.

    Returns the place and the GPU memory cap in bytes (0 on the CPU).
    """
    if "RANK" not in os.environ:  # a single process started without a launcher
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        exact_pinned_supported()  # sets the threshold, before DeepSpeed pins its offload buffers
        use_parallel_pinning(usable_cpus())  # those buffers' pages faulted in by several threads
        use_expandable_segments(expandable_segments)  # before the first CUDA allocation
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:  # torch sizes its pool to the affinity set, not the quota
            torch.set_num_threads(usable_cpus())
    clear_stale_locks()  # before DeepSpeed loads its first op (the CPU's shared-memory all-reduce, here)
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", verbose=False)
    cap_bytes = 0
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        fraction, cap_bytes = gpu_cap(gpu_profile(gpu), total, cap_memory)
        if fraction is not None:
            torch.cuda.set_per_process_memory_fraction(fraction, device)
    return Place(rank, local_rank, world_size, device, int(os.environ.get("GROUP_RANK", "0"))), cap_bytes


def gpu_cap(profile: GpuProfile, total_bytes: int, cap_memory: bool) -> tuple[float | None, int]:
    """(allocator fraction to set, or None for no cap; the bytes the allocator may reserve) on a card of
    `total_bytes` emulating `profile`: its memory less its CUDA context, which lives outside the allocator
    (the plan's verdict uses the same budget)."""
    if not cap_memory or profile.memory_bytes >= total_bytes:
        return None, total_bytes
    budget = allocator_budget_bytes(profile.memory_bytes, profile.cuda_context_bytes)
    return budget / total_bytes, budget


# How a collective says that a peer process is gone (it exited after its own failure): gloo's and NCCL's words
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "[gloo/", "NCCL communicator was aborted")


def peer_gone(error: BaseException) -> bool:
    """Whether `error` is a collective that broke because another rank left (its process ended, having said why)."""
    import torch.distributed as dist  # noqa: PLC0415 — as the collectives here do

    return isinstance(error, dist.DistNetworkError) or (
        isinstance(error, RuntimeError) and any(words in str(error) for words in _PEER_GONE)
    )


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when `flag` is true on any (one tiny all-reduce; a host sync)."""
    import torch.distributed as dist

    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def pair_forwards(micro_batches: int, place: Place) -> int:
    """The forwards a rank runs beyond its own `micro_batches` so that every rank runs the most any does (one tiny
    all-reduce; every rank calls it, before its first forward): ZeRO-3 gathers parameters in each forward, and a
    rank that stopped early left the others waiting in a gather."""
    return max_over_ranks(micro_batches, place.device) - micro_batches if place.world_size > 1 else 0


def sum_by_node(number: int, node: int, nodes: int, device: torch.device) -> list[int]:
    """Each node's sum of its ranks' `number` (e.g. host memory), in node order, the same on every rank
    (one all-reduce of `nodes` values; every rank must call it)."""
    import torch.distributed as dist

    value = torch.zeros(nodes, device=device, dtype=torch.float64)
    value[node] = float(number)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return [int(v) for v in value.tolist()]


def max_over_ranks(number: int, device: torch.device) -> int:
    """The largest of each rank's `number` (e.g. peak memory), the same on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return number
    value = torch.tensor([float(number)], device=device, dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())
