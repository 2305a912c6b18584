"""Pinned host buffers at their real size instead of the next power of two: how the planner prices them.

PyTorch's caching host allocator rounds every pinned allocation up to a power of two so that freed
blocks can be reused. DeepSpeed's offload pins a few huge flat buffers once (fp32 master weights,
their gradients, a bf16 staging copy), so the rounding buys no reuse and costs up to half of them:
a 4.4 GB buffer takes 8 GiB of page-locked RAM. Newer PyTorch has a threshold for the rounding
(`pinned_max_round_threshold_mb`: 2.13 has it, the GPU machine's 2.11 does not); a run sets it
(memtrain.train.runtime.allocator) so that only small pinned blocks (the data loader's batches) are rounded.
"""

from __future__ import annotations

from memtrain.units import MiB

ROUND_THRESHOLD_BYTES = 1 * MiB  # pinned blocks up to this size are still rounded (cheap, reused)


def pinned_bytes(size_bytes: int, exact: bool) -> int:
    """Page-locked bytes a pinned allocation of size_bytes takes under the caching host allocator."""
    if size_bytes <= 0:
        return 0
    if exact and size_bytes > ROUND_THRESHOLD_BYTES:
        return size_bytes
    return 1 << (size_bytes - 1).bit_length()
