"""DeepSpeed settings that both the planner prices and the config compiler writes: one owner for each.

The bucket rule is the one HF's "auto" uses: hidden² elements for reduce / all-gather buckets and
0.9·hidden² for ZeRO-3's prefetch bucket, unless the recipe names a size.
"""

from __future__ import annotations

import math

from memtrain.recipe.schema import Recipe


def bucket_elements(recipe: Recipe, hidden_size: int) -> tuple[int, int]:
    """(reduce bucket, ZeRO-3 prefetch bucket) in elements."""
    o = recipe.offload
    reduce = hidden_size * hidden_size if o.bucket_size == "auto" else o.bucket_size
    prefetch = int(0.9 * hidden_size * hidden_size) if o.prefetch_bucket_size == "auto" else o.prefetch_bucket_size
    return reduce, prefetch


def overlaps_comm(recipe: Recipe) -> bool:
    """offload.overlap_comm with auto resolved: overlap where reductions cross GPUs or states travel to the host or
    NVMe, not on one GPU that holds everything (nothing to overlap, buckets held for nothing)."""
    o = recipe.offload
    if o.overlap_comm != "auto":
        return o.overlap_comm
    return recipe.hardware.world_size > 1 or o.optimizer != "none" or o.params != "none"


def grad_accum_steps(global_batch: int, micro_batch: int, gpus: int) -> int:
    """Micro-batches per optimizer step per GPU (the last one may be smaller when it does not divide)."""
    return math.ceil(global_batch / (micro_batch * gpus))
