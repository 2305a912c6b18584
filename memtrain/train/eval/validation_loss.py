"""Evaluation at a micro-batch that fits: an out-of-memory error in an evaluation forward halves the
evaluation micro-batch and retries those samples, instead of ending a run whose training fits (users
report OOM in eval after training fit: eval runs at the training micro-batch with other buffers live).

Sums are added only after a forward completes, so a retried chunk is counted once. With ZeRO-3 and
several GPUs each forward gathers parameters collectively, so every rank runs as many forwards: a rank whose
share makes fewer micro-batches (the samples do not divide evenly) runs its first again and counts nothing of it
(`pair_forwards`; without it the others waited in a gather that never came). A rank that shrinks alone after an
OOM runs more forwards than the others, so there an OOM in evaluation still ends the run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from memtrain.train.runtime.distributed import Place, all_reduce_sum, pair_forwards
from memtrain.train.runtime.oom import abandon_failed_frames, is_oom, release_memory


def in_chunks(indices: list[int], size: int) -> list[list[int]]:
    """`indices` in consecutive chunks of `size` (the last may be shorter)."""
    return [indices[i : i + size] for i in range(0, len(indices), size)]


def run_shrinking(
    indices: list[int],
    micro_batch: int,
    run_one: Callable[[list[int]], None],
    device: torch.device,
    before: Callable[[int, int], None] | None = None,
    on_oom: Callable[[int], None] | None = None,
    split: Callable[[list[int], int], list[list[int]]] = in_chunks,
) -> int:
    """run_one(chunk) over `indices` in the chunks `split` makes at `micro_batch` (consecutive chunks of that many
    samples by default; a loader that lays samples out packed makes its own: BatchLoader.split); an OOM halves the
    size (down to 1, then re-raises) and splits the chunks not yet run again. `before(index, size)` runs before each
    chunk (a test hook); `on_oom(size)` hears of each OOM. Returns the size it finished at."""
    size, index = max(1, micro_batch), 0
    chunks = split(indices, size)
    while chunks:
        chunk = chunks[0]
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
            chunks = split([i for c in chunks for i in c], size)
            continue
        chunks.pop(0)
        index += 1
    return size


def evaluate(
    engine, loader, val_set, *, samples: int, micro_batch: int, place: Place, before=None, on_oom=None
) -> float:
    """Mean token loss over the first `samples` validation samples, shared out over the ranks.

    The sample set depends on neither the number of GPUs nor the current micro-batch, so runs on
    different hardware report comparable numbers. The loader makes the micro-batches (packed where it lays steps
    out packed). An OOM halves the evaluation micro-batch (run_shrinking).
    """
    device, world_size, rank = place.device, place.world_size, place.rank
    engine.eval()
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    tokens = torch.zeros((), device=device, dtype=torch.float64)
    mine = list(range(rank, min(len(val_set), samples), world_size))

    def one(indices):
        nonlocal loss_sum, tokens
        batch = loader.get(indices)
        torch.compiler.cudagraph_mark_step_begin()  # layers that replay CUDA graphs may reuse the last outputs' memory
        token_loss_sum, n_targets = engine(**batch)
        loss_sum += token_loss_sum.double()
        tokens += n_targets.double() if torch.is_tensor(n_targets) else n_targets

    with torch.no_grad():
        extra = pair_forwards(len(loader.split(mine, micro_batch)), place)
        run_shrinking(mine, micro_batch, one, device, before=before, on_oom=on_oom, split=loader.split)
        spare = loader.split(mine or [0], micro_batch)[0] if extra else []
        for _ in range(extra):
            engine(**loader.get(spare))  # its gathers only: nothing counted
    engine.train()
    totals = all_reduce_sum(torch.stack([loss_sum, tokens]))
    return float(totals[0] / totals[1].clamp(min=1))
