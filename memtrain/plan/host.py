"""Host RAM of DeepSpeed's CPU offload, buffer by buffer (DeepSpeed 0.19, PyTorch's host allocator).

The logical model states (`model_states.py`: master weights, gradients, Adam moments) are not what
the host holds. DeepSpeed adds staging copies and accumulation buffers, and every buffer it pins
goes through PyTorch's caching host allocator, which rounds the size up to a power of two unless
the rounding threshold is set (`memtrain.plan.pinned`; PyTorch 2.13 has it, 2.11 not). What is priced here:

ZeRO-1/2, optimizer on the CPU (per rank, its partition of n trainable elements):
  master weights   pinned, n × master bytes (4, or 2 with bf16 master weights)
  staging copy     pinned, n × compute bytes (the updated weights on their way back to the GPU)
  gradients        pinned, n × master bytes (the optimizer's gradient partition)
  Adam moments     2 × n × state bytes, plain memory (CPU Adam allocates them lazily)
  accumulation     with fp32 master weights and more than one micro-batch per step, one pinned
                   compute-dtype buffer per trainable tensor (each rounded on its own)
  transfer buffer  pinned, the largest trainable tensor in the compute dtype
ZeRO-3, optimizer on the CPU (sub-groups of at most `sub_group_size` elements):
  master weights   n × master bytes, plain; Adam moments as above
  gradients        a pinned compute-dtype flat buffer of n, and a pinned master-dtype buffer per sub-group
  parameters       with params on the CPU: a pinned compute-dtype flat buffer of the whole model, and
                   the pinned per-tensor partitions zero.Init made while building it: DeepSpeed copies
                   them into the flat buffer, and the freed blocks stay in PyTorch's host cache (with
                   offload.pin_memory false they are plain memory, returned when freed)
                   (measured on the H200: 3B +8.4 GiB, 7B +16.4 GiB beyond the flat buffer, which is
                   2.6 bytes per parameter: 2 bytes rounded up tensor by tensor)
ZeRO-3, optimizer on NVMe:
  gradients        the pinned compute-dtype flat buffer of n, as above
  pinning copy     while deepspeed.initialize pins that buffer, the plain buffer it was made from (zeroed,
                   so resident) is alive beside the pinned copy: n more compute-dtype bytes at that moment,
                   which is the host peak when nothing larger comes later (measured on the CPU with DeepSpeed's
                   native pinning: 1.1B and 3B, +n × 2 at stage3.py's pin of the gradient partition). With the
                   optimizer on the CPU the Adam states, allocated later, outweigh it
  swap buffers     (model_states.py) max(4, buffer_count) page-locked buffers of the largest sub-group
                   in the master dtype; with parameters on NVMe too, one page-locked copy of the largest
                   sub-group in the compute dtype (the updated weights on their way to disk) and
                   buffer_count buffers of the largest tensor
"""

from __future__ import annotations

from memtrain.dtypes import DTYPE_BYTES
from memtrain.plan.model_states import master_bytes, split_sub_groups, sub_group_elements
from memtrain.plan.params import ParamCounts
from memtrain.plan.pinned import pinned_bytes


def offload_host_bytes(
    counts: ParamCounts,
    *,
    stage: int,
    gpus: int,
    storage: str,
    master: str,
    optimizer_tier: str,
    params_tier: str,
    pin_memory: bool,
    exact_pinned: bool,
    accumulates: bool,
    world_size: int | None = None,
    ratio: float = 1.0,
) -> dict[str, int]:
    """Host bytes of the offloaded model states by buffer, summed over the `gpus` ranks of the machine.

    world_size: the ranks ZeRO partitions over, on every node (default `gpus`: one node). Each of this
    machine's ranks holds its 1 / world_size share; other nodes hold theirs in their own memory.

    storage: dtype of the weights on the GPU (bf16 / fp16, or fp32 under precision.mode autocast).
    master: "fp32" or "bf16" (bf16 master weights and optimizer states).
    accumulates: whether a step runs more than one micro-batch on a rank.
    ratio: ZeRO-3's partial offload (`offload.ratio`): the first sub-groups stay on the GPU.
    """

    def pin(size: int) -> int:
        return pinned_bytes(size, exact_pinned) if pin_memory else size

    world = world_size or gpus
    weight_bytes, state_bytes = DTYPE_BYTES[storage], master_bytes(storage, master)
    out = {
        "params": 0,
        "master_weights": 0,
        "gradients": 0,
        "optimizer_states": 0,
        "staging_buffers": 0,
        "pinning_copy": 0,
    }
    if optimizer_tier == "cpu":
        n = counts.trainable // world if stage >= 1 else counts.trainable
        out["optimizer_states"] = gpus * 2 * n * state_bytes
        if stage == 3:
            rank_numels = [k // world for k in counts.trainable_numels]
            gpu_groups, host_groups = split_sub_groups(rank_numels, sub_group_elements("cpu", ratio), ratio)
            on_host = n - sum(gpu_groups)
            out["optimizer_states"] = gpus * 2 * on_host * state_bytes
            out["master_weights"] = gpus * on_host * state_bytes
            # Each sub-group's gradient buffer is made on the host; a GPU sub-group's is copied to the GPU
            # and dropped, which a pinned block survives in PyTorch's host cache and a plain one does not.
            kept = gpu_groups + host_groups if pin_memory else host_groups
            out["gradients"] = gpus * (pin(n * weight_bytes) + sum(pin(s * state_bytes) for s in kept))
        else:
            out["master_weights"] = gpus * pin(n * state_bytes)
            out["gradients"] = gpus * pin(n * state_bytes)
            staging = pin(n * weight_bytes) + pin(max(counts.trainable_numels, default=0) * weight_bytes)
            if accumulates and state_bytes == 4:
                staging += sum(pin(k * weight_bytes) for k in counts.trainable_numels) // world
            out["staging_buffers"] = gpus * staging
    if optimizer_tier == "nvme":
        # ZeRO-3's flat gradient partition stays in host memory (in the compute dtype); the states, the
        # master weights and their fp32 gradients go to disk through the swap buffers (model_states.py)
        partition = counts.trainable // world * weight_bytes
        out["gradients"] = gpus * pin(partition)
        if pin_memory:
            out["pinning_copy"] = gpus * partition
    if stage == 3 and params_tier == "cpu":
        flat = pin(counts.weight_bytes(weight_bytes) // world)
        # pinned blocks stay in PyTorch's host cache once freed; plain ones go back to the system
        init_partitions = sum(pin(k * weight_bytes // world) for k in counts.tensor_numels) if pin_memory else 0
        out["params"] = gpus * (flat + init_partitions)
    return out
