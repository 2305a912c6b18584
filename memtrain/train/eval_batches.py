"""Evaluation at a micro-batch that fits: an out-of-memory error in an evaluation forward halves the
evaluation micro-batch and retries those samples, instead of ending a run whose training fits (users
report OOM in eval after training fit: eval runs at the training micro-batch with other buffers live).

Sums are added only after a forward completes, so a retried chunk is counted once. With ZeRO-3 and
several GPUs each forward gathers parameters collectively; a rank that shrinks alone runs more
forwards than the others, so there an OOM in evaluation still ends the run.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from memtrain.train.oom import abandon_failed_frames, is_oom, release_memory


def run_shrinking(indices: list[int], micro_batch: int, run_one: Callable[[list[int]], None], device: torch.device,
                  before: Callable[[int, int], None] | None = None,
                  on_oom: Callable[[int], None] | None = None) -> int:
    """run_one(chunk) over `indices` in chunks of `micro_batch`; an OOM halves the size (down to 1, then
    re-raises) and retries the chunk. `before(index, size)` runs before each chunk (a test hook);
    `on_oom(size)` hears of each OOM. Returns the size it finished at."""
    position, size, index = 0, max(1, micro_batch), 0
    while position < len(indices):
        chunk = indices[position:position + size]
        try:
            if before is not None:
                before(index, len(chunk))
            run_one(chunk)
        except Exception as error:  # noqa: BLE001 — only OOMs are handled; the rest re-raise
            if not is_oom(error) or size == 1:
                raise
            abandon_failed_frames(error)
            release_memory(device)
            if on_oom is not None:
                on_oom(size)
            size = max(1, size // 2)
            continue
        position += len(chunk)
        index += 1
    return size
