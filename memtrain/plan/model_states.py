"""Where model states live: parameters, gradients and optimizer states per GPU, on the host and on NVMe.

Pure arithmetic on parameter counts, the ZeRO stage and the offload tiers. Per GPU means per rank;
host and NVMe are totals over the ranks of one machine.
"""

from __future__ import annotations

from dataclasses import dataclass

from memtrain.dtypes import DTYPE_BYTES
from memtrain.plan.params import ParamCounts

SUB_GROUP_ELEMENTS = 1_000_000_000  # the compiled config's sub_group_size (memtrain.ds_config.compiler)
# With optimizer states on NVMe every swap buffer holds a whole sub-group in the master dtype: at 1e9
# elements five of them pinned 19 GiB of host memory for a 1.1B model (measured on the H200, 34.9 GiB
# in all), which is what the NVMe tier exists to avoid.
NVME_SUB_GROUP_ELEMENTS = 100_000_000


def sub_group_elements(optimizer_tier: str, ratio: float = 1.0) -> int:
    """ZeRO-3's sub_group_size for this optimizer tier (what the compiler writes). A partial offload
    (ratio < 1) moves whole sub-groups to the GPU, so it takes the small size too: at 1e9 a 7B model has
    7 sub-groups and a ratio of 0.9 moves none of them."""
    return NVME_SUB_GROUP_ELEMENTS if optimizer_tier == "nvme" or ratio < 1.0 else SUB_GROUP_ELEMENTS


def sub_groups(numels: tuple[int, ...] | list[int], size: int) -> list[int]:
    """Elements of each of ZeRO-3's sub-groups, in order: tensors are taken in order into a group until
    it holds `size` or more (stage3.py `_create_fp16_sub_groups`); one group when they are fewer."""
    total = sum(numels)
    if total <= size:
        return [total] if total else []
    groups, current = [], 0
    for numel in numels:
        current += numel
        if current >= size:
            groups.append(current)
            current = 0
    return groups + ([current] if current else [])


def largest_sub_group(numels: tuple[int, ...] | list[int], size: int) -> int:
    """Elements of ZeRO-3's largest sub-group (see `sub_groups`)."""
    return max(sub_groups(numels, size), default=0)


def split_sub_groups(numels: tuple[int, ...] | list[int], size: int, ratio: float) -> tuple[list[int], list[int]]:
    """ZeRO-3's sub-groups as a partial optimizer offload (`offload.ratio` < 1) places them: (on the GPU, on
    the host). The first int((1 - ratio) × count) stay on the GPU (stage3.py, `subgroup_to_device`): their
    master weights, moments and gradients live there and torch's AdamW updates them. None without one."""
    groups = sub_groups(numels, size)
    on_gpu = int((1 - ratio) * len(groups)) if ratio < 1.0 else 0
    return groups[:on_gpu], groups[on_gpu:]


@dataclass(frozen=True)
class StateBytes:
    gpu_params: int
    gpu_gradients: int
    gpu_optimizer_states: int
    host_params: int
    host_gradients: int
    host_optimizer_states: int
    host_swap_buffers: int
    nvme_params: int
    nvme_optimizer_states: int

    def total(self, gpus: int) -> int:
        """All bytes of model states of the run, over every GPU, the host and NVMe."""
        gpu = self.gpu_params + self.gpu_gradients + self.gpu_optimizer_states
        return (
            gpu * gpus
            + self.host_params
            + self.host_gradients
            + self.host_optimizer_states
            + self.nvme_params
            + self.nvme_optimizer_states
        )


EIGHT_BIT_BLOCK = 256  # bitsandbytes' 8-bit optimizers: one fp32 scale per 256 values of each moment


def master_bytes(storage: str, master: str) -> int:
    """Bytes per element of the master weights, their gradients and Adam's moments: 4, or 2 with
    bf16 master weights (fp32 weights are their own master copy, in fp32)."""
    return 4 if master == "fp32" or storage == "fp32" else 2


def optimizer_bytes_per_param(compute: str, master: str, eight_bit: bool = False, in_backward: bool = False) -> float:
    """Bytes of optimizer state per trainable parameter: a master copy (unless compute is fp32) + Adam's two moments.

    eight_bit: bitsandbytes' 8-bit AdamW keeps each moment in one byte plus a block scale (the
    master copy stays DeepSpeed's).
    in_backward: optimizer.step_in_backward updates the weights in place: no master copy.
    """
    state = master_bytes(compute, master)
    master_copy = 0 if compute == "fp32" or in_backward else state
    moment = 1 + 4 / EIGHT_BIT_BLOCK if eight_bit else state
    return master_copy + 2 * moment


def place_model_states(
    counts: ParamCounts,
    *,
    stage: int,
    gpus: int,
    compute: str,
    master: str,
    optimizer_tier: str,
    params_tier: str,
    ratio: float = 1.0,
    buffer_count: int = 5,
    eight_bit: bool = False,
    local_ranks: int | None = None,
    in_backward: bool = False,
    paged: bool = False,
) -> StateBytes:
    """Bytes of parameters, gradients and optimizer states on each tier.

    gpus: the ranks ZeRO partitions over (every node's); local_ranks: those on this machine (default
    `gpus`: one node), whose host and NVMe bytes are summed here — per node, not over the run.

    ZeRO-1 partitions optimizer states over ranks, ZeRO-2 also gradients, ZeRO-3 also parameters.
    An offloaded optimizer keeps its fp32 (or bf16) gradient partition beside it on the host; the
    GPU then only streams gradients through the reduce buckets (priced as DeepSpeed buffers).

    in_backward (optimizer.step_in_backward, one GPU, no offload): each gradient is freed as soon as its
    parameter is updated, so one tensor's gradient at a time, and no master copy.
    paged: bitsandbytes' paged optimizers keep their states in CUDA unified memory, outside PyTorch's
    allocator: on the host here (where they go when the card is full; the card holds what fits beside
    PyTorch's reserved memory), not in the GPU's reserved bytes.
    """
    if optimizer_tier == "nvme" and stage != 3:
        # DeepSpeed's ZeRO-1/2 optimizer takes any offload device for the CPU (stage_1_and_2.py): pricing its
        # states on NVMe would hide them from the host check; validate refuses such a recipe (recipe/rules.py)
        raise ValueError(f"optimizer states go to NVMe only under ZeRO-3, not ZeRO-{stage}")
    compute_bytes = DTYPE_BYTES[compute]
    grad_host_bytes = master_bytes(compute, master)
    per_param_optimizer = optimizer_bytes_per_param(compute, master, eight_bit, in_backward)
    params_bytes = counts.total * compute_bytes
    grads_bytes = counts.trainable * compute_bytes
    if in_backward:
        grads_bytes = min(counts.trainable, max(counts.trainable_numels, default=counts.trainable)) * compute_bytes
    optimizer_bytes = int(counts.trainable * per_param_optimizer)

    local = local_ranks or gpus
    node_share = local / gpus  # this node's ranks hold this share of what ZeRO partitions
    gpu_params = host_params = nvme_params = 0
    if stage == 3 and params_tier == "cpu":
        host_params = int(params_bytes * node_share)
    elif stage == 3 and params_tier == "nvme":
        nvme_params = int(params_bytes * node_share)
    else:
        gpu_params = params_bytes // gpus if stage == 3 else params_bytes

    gpu_gradients = host_gradients = 0
    if optimizer_tier == "none":
        gpu_gradients = grads_bytes // gpus if stage >= 2 else grads_bytes
    else:
        host_gradients = int(counts.trainable * grad_host_bytes * (node_share if stage >= 1 else 1))

    gpu_optimizer = host_optimizer = nvme_optimizer = 0
    partition = gpus if stage >= 1 else 1
    if optimizer_tier == "none" and paged:
        host_optimizer = optimizer_bytes * local // partition
    elif optimizer_tier == "none":
        gpu_optimizer = optimizer_bytes // partition
    elif optimizer_tier == "cpu":
        rank_numels = [k // gpus for k in counts.trainable_numels] if stage == 3 else []
        on_gpu = sum(split_sub_groups(rank_numels, sub_group_elements(optimizer_tier, ratio), ratio)[0])
        gpu_optimizer = int(on_gpu * per_param_optimizer)
        gpu_gradients = on_gpu * grad_host_bytes
        host_optimizer = int(optimizer_bytes * (node_share if stage >= 1 else 1)) - gpu_optimizer * local
        host_gradients -= gpu_gradients * local
    else:
        nvme_optimizer = int(optimizer_bytes * (node_share if stage >= 1 else 1))

    # NVMe tiers read and write through page-locked host buffers (DeepSpeed's aio, exact sizes): the
    # optimizer's hold a whole sub-group each (its master weights, two moments and gradients take 4 of
    # them at a time), the parameters' one tensor each.
    swap = 0
    if optimizer_tier == "nvme" or nvme_params:
        sub_group = largest_sub_group(
            [k // gpus for k in counts.trainable_numels], sub_group_elements(optimizer_tier, ratio)
        )
        if optimizer_tier == "nvme":
            swap += max(4, buffer_count) * sub_group * grad_host_bytes * local
        if nvme_params:
            swap += (sub_group + buffer_count * counts.largest_tensor) * compute_bytes * local
    return StateBytes(
        gpu_params=gpu_params,
        gpu_gradients=gpu_gradients,
        gpu_optimizer_states=gpu_optimizer,
        host_params=host_params,
        host_gradients=host_gradients,
        host_optimizer_states=host_optimizer,
        host_swap_buffers=swap,
        nvme_params=nvme_params,
        nvme_optimizer_states=nvme_optimizer,
    )
