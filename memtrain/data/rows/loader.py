"""Which samples each step sees (a resumable shuffled order) and getting them onto the device ahead of time.

Length bucketing (recipe data.group_by_length; on by default when rows are not packed): the rows of one
epoch, in their seeded shuffle, are taken a mega-batch of BUCKET_STEPS optimizer steps at a time, sorted
by length within it and cut into step-sized groups, and those groups are shuffled. Every step (and so every
micro-batch cut from it) then holds rows of similar length, and the loader cuts each micro-batch to its
longest row (`batch_width`) instead of seq_len: padding that is never computed. It is the idea of
Hugging Face's group_by_length; the order stays a pure function of (seed, epoch, lengths), so a resumed
run sees the same rows in the same micro-batches.

Rows laid out packed (`pack_steps`; unpacked sample rows where the attention kernel takes sample bounds without a
mask, memtrain.model.attention.packs_steps): a step still holds its global batch of samples, but they are laid end
to end into rows of seq_len as packed data is (best fit, longest first), and the rows go `micro_batch` to a micro-batch
(`packed_micro_batches`). Micro-batches then have the packed shape, instead of one width each: on a GPU every new
width cost a new attention plan and a recompiled layer (measured: a step of 4 cut micro-batches took 2.3 s whether
it held 1,100 or 12,000 tokens), and short samples no longer each take a row. Steps are then not bucketed by
length unless the recipe asks: samples of one length fill rows worst (a step of 16 conversations of 100-1,500
tokens: 30 % padding bucketed, 11 % shuffled). The loss is the same: labels, positions and the normalisation by
the step's targets do not depend on where a sample lies. With several processes each rank lays its share of the step
into rows of its own, and every rank runs the most micro-batches any makes (`packed_step_micro_batches`): the ranks
share an out-of-memory flag at every micro-batch and ZeRO-2 reduces gradients in every backward, so their
micro-batches must pair. A rank with fewer rows deals them out thinner, or splits its fullest rows.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from memtrain.data.rows.packing import pack_rows
from memtrain.data.rows.pieces import cut_documents
from memtrain.labels import IGNORE_INDEX
from memtrain.recipe.schema import Data

# Steps whose rows are sorted together: larger gives groups of more alike lengths, smaller keeps more of the
# shuffle in which rows meet in a step (Hugging Face's group_by_length sorts 50 batches at a time).
BUCKET_STEPS = 50
# The width policy of cut micro-batches (`batch_width`, its one owner): as wide as the longest row, rounded up to
# this. 8 keeps matmuls tensor-core friendly and pads at most 7 positions a row; it also allows up to seq_len / 8
# distinct widths, each a new shape for the caching allocator, the attention kernels' autotuning and compiled
# layers (a recompile per new width until dynamo marks the dimension dynamic). Whether a coarser rounding (fewer
# shapes, more padding) pays is for a GPU profile over enough steps that every width has been seen to say.
WIDTH_MULTIPLE_TOKENS = 8
# Mixed into the seed for the shuffle of the groups, independent of the other seeded streams.
BUCKET_STREAM = 0x62756B


def batch_width(lengths: np.ndarray, seq_len: int) -> int:
    """Token positions a micro-batch of rows with these real lengths is cut to (rows are right-padded): the
    longest row rounded up to WIDTH_MULTIPLE_TOKENS, at most seq_len (the width policy, module constants)."""
    longest = int(np.max(lengths)) if len(lengths) else 1
    return min(seq_len, -(-longest // WIDTH_MULTIPLE_TOKENS) * WIDTH_MULTIPLE_TOKENS)


class SampleOrder:
    """Maps a global sample cursor (samples consumed since the run began, over all epochs) to dataset indices.

    Each epoch is a fresh permutation from (seed, epoch); deterministic, so a resumed run sees the same
    samples in the same order. With `lengths` (one per sample) the epoch is length-bucketed in groups of
    `group` samples, one optimizer step's (module doc): still every sample once per epoch.
    """

    def __init__(
        self,
        n_samples: int,
        seed: int,
        lengths: np.ndarray | None = None,
        group: int = 1,
        bucket_steps: int = BUCKET_STEPS,
    ):
        if n_samples < 1:
            raise ValueError(f"n_samples must be at least 1, got {n_samples}")
        if lengths is not None and len(lengths) != n_samples:
            raise ValueError(f"lengths has {len(lengths)} entries for {n_samples} samples")
        if group < 1 or bucket_steps < 1:
            raise ValueError(f"group ({group}) and bucket_steps ({bucket_steps}) must be >= 1")
        self.n_samples = n_samples
        self.seed = seed
        self.lengths = None if lengths is None else np.asarray(lengths, dtype=np.int64)
        self.group = group
        self.bucket_steps = bucket_steps
        self._bucketed: OrderedDict[int, np.ndarray] = OrderedDict()

    def epoch_of(self, cursor: int) -> int:
        """The epoch (from 0) that sample number `cursor` belongs to."""
        if cursor < 0:
            raise ValueError(f"cursor must be >= 0, got {cursor}")
        return cursor // self.n_samples

    def permutation(self, epoch: int) -> np.ndarray:
        """Dataset indices in the order epoch `epoch` visits them."""
        shuffled = _permutation(self.n_samples, self.seed, epoch)
        if self.lengths is None:
            return shuffled
        if epoch not in self._bucketed:
            self._bucketed[epoch] = self._bucket(shuffled, epoch)
            while len(self._bucketed) > 2:  # the loop reads at most two epochs at a time
                self._bucketed.popitem(last=False)
        return self._bucketed[epoch]

    def _bucket(self, shuffled: np.ndarray, epoch: int) -> np.ndarray:
        """The epoch's shuffle, sorted by length within mega-batches and cut into step groups, groups shuffled.

        Groups are aligned with the run's steps: when epochs do not hold a whole number of steps, the epoch
        starts with the rest of a step begun in the previous one. Only full groups are shuffled; a last,
        partial group stays last, so the groups after it keep their alignment.
        """
        lengths, group = self.lengths, self.group
        rng = np.random.default_rng([self.seed, epoch, BUCKET_STREAM])
        head = (-epoch * self.n_samples) % group  # samples that complete a step begun in the previous epoch
        pieces = [_longest_first(shuffled[:head], lengths)]
        mega = group * self.bucket_steps
        for begin in range(head, self.n_samples, mega):
            chunk = _longest_first(shuffled[begin : begin + mega], lengths)
            full = len(chunk) // group
            groups = chunk[: full * group].reshape(full, group)
            pieces += [groups[rng.permutation(full)].reshape(-1), chunk[full * group :]]
        order = np.concatenate(pieces)
        order.flags.writeable = False
        return order

    def indices(self, start: int, count: int) -> list[int]:
        """Dataset indices of samples start .. start+count-1 of the run; may span epoch boundaries."""
        if start < 0 or count < 0:
            raise ValueError(f"start and count must be >= 0, got {start}, {count}")
        out: list[int] = []
        cursor, end = start, start + count
        while cursor < end:
            epoch, offset = divmod(cursor, self.n_samples)
            take = min(end - cursor, self.n_samples - offset)
            out.extend(self.permutation(epoch)[offset : offset + take].tolist())
            cursor += take
        return out


@functools.lru_cache(maxsize=4)
def _permutation(n_samples: int, seed: int, epoch: int) -> np.ndarray:
    # SeedSequence([seed, epoch]) gives independent, platform-stable streams per epoch.
    order = np.random.default_rng([seed, epoch]).permutation(n_samples)
    order.flags.writeable = False  # shared through the cache
    return order


def _longest_first(indices: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    return indices[np.argsort(-lengths[indices], kind="stable")]


def sample_order(data: Data, train_set, seed: int, global_batch: int, pack_steps: bool = False) -> SampleOrder:
    """The training order of a run: bucketed by the rows' lengths when the recipe groups by length (by default not
    when steps are laid out packed: module doc)."""
    bucketed = data.group_by_length if pack_steps else data.groups_by_length  # None: not asked
    if not bucketed:
        return SampleOrder(len(train_set), seed)
    return SampleOrder(len(train_set), seed, lengths=train_set.lengths, group=global_batch)


def token_slots(
    order: SampleOrder,
    dataset,
    global_batch: int,
    per_rank_batch: int,
    micro_batch: int,
    trim: bool,
    steps: int,
    pack_steps: bool = False,
) -> int:
    """Token positions the first `steps` optimizer steps compute, over all ranks (`step_positions` of each); the
    planner prices padding with it, and the run's start record says the padding share it gives."""
    return sum(
        step_positions(
            dataset,
            order.indices(step * global_batch, global_batch),
            per_rank_batch,
            micro_batch,
            trim,
            pack_steps=pack_steps,
        )
        for step in range(steps)
    )


def step_positions(
    dataset, samples: list[int], per_rank_batch: int, micro_batch: int, trim: bool, pack_steps: bool = False
) -> int:
    """Token positions one optimizer step over `samples` (the global batch, rank after rank) computes: rows × width
    per micro-batch, the width `batch_width` when micro-batches are cut, else seq_len; with `pack_steps`, the rows
    each rank's share is laid into (split where ranks run more micro-batches than it fills). Padding included."""
    if pack_steps:  # whole rows: as many as a rank's share fills, or one a micro-batch where ranks need more
        rows = _rows_of_ranks(dataset, samples, per_rank_batch)
        count = _most_micro_batches(rows, micro_batch)
        return sum(max(made, count) for made in rows) * packing_units(dataset)[1]
    positions = 0
    for rank_start in range(0, len(samples), per_rank_batch):
        mine = samples[rank_start : rank_start + per_rank_batch]
        for start in range(0, len(mine), micro_batch):
            rows = mine[start : start + micro_batch]
            width = batch_width(dataset.lengths[rows], dataset.seq_len) if trim else dataset.seq_len
            positions += len(rows) * getattr(dataset, "sequences_per_item", 1) * width  # a pair is two rows
    return positions


def next_fit_rows(lengths, seq_len: int) -> list[list[int]]:
    """The positions of `lengths` in rows of seq_len, in order: a new row wherever the next sample does not fit the
    current one. On rows written out one after the other, which `packed_micro_batches` makes, it gives those rows
    back: a row's first sample opened it, when no row before it had the room (packing.pack_rows)."""
    rows: list[list[int]] = []
    free = 0
    for at, length in enumerate(int(n) for n in lengths):
        if not rows or length > free:
            rows.append([])
            free = seq_len
        rows[-1].append(at)
        free -= length
    return rows


def packing_units(dataset) -> tuple[np.ndarray, int]:
    """(each item's tokens, the width of the rows items are laid into when a step is laid out packed): a sample
    row's real length and seq_len; a preference pair's two sequences together and twice seq_len
    (pairs.PairRows.packing_units: the positions of the two rows a pair takes unpacked)."""
    units = getattr(dataset, "packing_units", None)
    return units() if units is not None else (dataset.lengths, dataset.seq_len)


def densest_row_samples(dataset) -> int:
    """The most sequences one row of seq_len tokens may hold as the run lays its rows out, for the planner (the
    attention kernel's backward grows with them): a packed row's samples; where steps are laid out packed, as many of
    the shortest items as fit a row's width (an upper bound; a pair's two sequences over its two rows' width)."""
    lengths, width = packing_units(dataset)
    row_starts = getattr(dataset, "row_starts", None)
    return densest_row(lengths, width, np.diff(row_starts) if row_starts is not None else None)


def densest_row(item_tokens, width: int, samples_per_item=None) -> int:
    """`densest_row_samples` of items (a dataset's rows, or pairs) of these real token counts laid into rows of
    `width`, holding `samples_per_item` samples each (None: one): the fullest item's samples, or as many of the
    shortest items as fit `width` where steps are laid out packed, whichever is more; 1 at least."""
    item_tokens = np.asarray(item_tokens, dtype=np.int64)
    shortest_that_fit = int(np.searchsorted(np.cumsum(np.sort(item_tokens)), width, side="right"))
    fullest = int(np.max(samples_per_item)) if samples_per_item is not None and len(samples_per_item) else 1
    return max(1, fullest, shortest_that_fit)


def densest_row_at(sample_tokens, width: int, *, truncation: str, packing: bool, documents=()) -> int:
    """`densest_row_samples` of the training set these samples would make at data.seq_len `width`, fitted and laid
    out as the data code does it at that length (data/rows/mixture.py's `_prepare` and `_rows`):

    sample_tokens: each instruction or chat sample's token count, whole; one longer than the row keeps its first
      `width` tokens (truncation "truncate") or is left out ("drop");
    documents: each text-dataset document's token count, cut into pieces of `width`, a last piece of one token (no
      target) left out;
    packing: rows packed by `pack_rows` (data.packing), the fullest row's samples counted; else one sample a row.
    """
    fitted = fitted_tokens(sample_tokens, width, truncation=truncation, documents=documents)
    if not packing:
        return densest_row(fitted, width)
    rows = pack_rows(fitted, width)
    return densest_row([int(fitted[row].sum()) for row in rows], width, [len(row) for row in rows])


def rows_at(sample_tokens, width: int, *, truncation: str, packing: bool, documents=()) -> int:
    """The rows (what batch.global_batch counts) the training set of these samples makes at data.seq_len `width`,
    fitted as `densest_row_at` fits them: packed rows where data.packing, else one sample a row."""
    fitted = fitted_tokens(sample_tokens, width, truncation=truncation, documents=documents)
    return len(pack_rows(fitted, width)) if packing else len(fitted)


def fitted_tokens(sample_tokens, width: int, *, truncation: str, documents=()) -> np.ndarray:
    """The token counts of the samples at data.seq_len `width` (`densest_row_at`'s arguments): samples truncated or
    left out, documents cut into pieces."""
    if truncation not in ("truncate", "drop"):
        raise ValueError(f"truncation must be 'truncate' or 'drop', got {truncation!r}")
    tokens = np.asarray(sample_tokens, dtype=np.int64)
    fitted = np.minimum(tokens, width) if truncation == "truncate" else tokens[tokens <= width]
    return np.concatenate([fitted, document_pieces(documents, width)])


def document_pieces(document_tokens, width: int) -> np.ndarray:
    """The token counts of documents of these lengths cut into pieces of `width`, as a text dataset of data.train is
    cut (pieces.cut_documents); a piece of one token, which has no target, left out."""
    documents = np.asarray(document_tokens, dtype=np.int64)
    _, _, lengths = cut_documents(np.zeros(len(documents), dtype=np.int64), documents, width)
    return lengths[lengths > 1]


def packed_rows(dataset, samples: list[int]) -> list[list[int]]:
    """A step's `samples` (dataset rows of one sample each, or pairs) laid into rows (`packing_units`) as packed data
    is (best fit, longest first: packing.pack_rows): each row's samples."""
    lengths, width = packing_units(dataset)
    return [[samples[at] for at in row] for row in pack_rows(lengths[samples], width)]


def packed_micro_batches(dataset, samples: list[int], micro_batch: int, count: int | None = None) -> list[list[int]]:
    """`packed_rows` taken `micro_batch` at a time: each micro-batch is its rows' samples written out row after row
    (`next_fit_rows` reads the rows back). The last may hold fewer rows.

    count: exactly this many micro-batches, the most any rank's share of the step makes (several processes must run
    as many as each other). The rows then go to them in order, as evenly as they divide (at most `micro_batch`
    each); where there are fewer rows than that, the rows of most samples are split in two until there are as many,
    and each micro-batch is one row (a row's halves in two micro-batches, where reading back cannot join them). It
    must lie between the micro-batches the rows need and the samples there are."""
    rows = packed_rows(dataset, samples)
    if count is None:
        return [sum(rows[start : start + micro_batch], []) for start in range(0, len(rows), micro_batch)]
    if not -(-len(rows) // micro_batch) <= count <= len(samples):
        raise ValueError(
            f"{len(samples)} samples in {len(rows)} rows cannot make {count} micro-batches of at most "
            f"{micro_batch} rows"
        )
    while len(rows) < count:
        fullest = max(range(len(rows)), key=lambda at: len(rows[at]))
        half = len(rows[fullest]) // 2
        rows[fullest : fullest + 1] = [rows[fullest][:half], rows[fullest][half:]]
    sizes = [len(rows) // count + (at < len(rows) % count) for at in range(count)]
    starts = np.cumsum([0, *sizes])
    return [sum(rows[starts[at] : starts[at + 1]], []) for at in range(count)]


def micro_batches_of(
    dataset, samples: list[int], micro_batch: int, pack_steps: bool = False, count: int | None = None
) -> list[list[int]]:
    """A rank's samples of one step in micro-batches: `micro_batch` rows each, or packed (`packed_micro_batches`, in
    `count` micro-batches where given)."""
    if pack_steps:
        return packed_micro_batches(dataset, samples, micro_batch, count)
    return [samples[i : i + micro_batch] for i in range(0, len(samples), micro_batch)]


def packed_step_micro_batches(dataset, samples: list[int], per_rank_batch: int, micro_batch: int) -> int:
    """The micro-batches a step laid out packed runs on every rank: the most any rank's share of `samples` (the
    global batch, rank after rank) makes (`packed_micro_batches`)."""
    return _most_micro_batches(_rows_of_ranks(dataset, samples, per_rank_batch), micro_batch)


def _rows_of_ranks(dataset, samples: list[int], per_rank_batch: int) -> list[int]:
    """How many rows each rank's share of `samples` (the global batch, rank after rank) is laid into (`packed_rows`)."""
    return [
        len(packed_rows(dataset, samples[start : start + per_rank_batch]))
        for start in range(0, len(samples), per_rank_batch)
    ]


def _most_micro_batches(rows_of_ranks: list[int], micro_batch: int) -> int:
    return max(-(-rows // micro_batch) for rows in rows_of_ranks)


def collate_packed(dataset, indices: list[int]) -> dict[str, torch.Tensor]:
    """The samples at `indices` (dataset rows of one sample each, right-padded) laid end to end in rows of seq_len
    (`next_fit_rows`): each row holds its samples' real positions, then padding (input pad_id, label -100,
    positions going on from the last sample's). Every item's labels already ignore its first token, so no sample
    learns to predict the one after it."""
    seq_len = dataset.seq_len
    lengths = dataset.lengths[np.asarray(indices, dtype=np.int64)]
    groups = next_fit_rows(lengths, seq_len)
    pad_id = int(getattr(dataset, "pad_id", 0))
    input_ids = torch.full((len(groups), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((len(groups), seq_len), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((len(groups), seq_len), dtype=torch.long)
    for row, group in enumerate(groups):
        at = 0
        for member in group:
            length, item = int(lengths[member]), dataset[indices[member]]
            input_ids[row, at : at + length] = item["input_ids"][:length]
            labels[row, at : at + length] = item["labels"][:length]
            position_ids[row, at : at + length] = item["position_ids"][:length]
            at += length
        last = int(position_ids[row, at - 1])
        position_ids[row, at:] = torch.arange(last + 1, last + 1 + seq_len - at)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def collate(dataset, indices: list[int], trim: bool = False, pack: bool = False) -> dict[str, torch.Tensor]:
    """Stack dataset[i] for i in `indices` into one batch: each key becomes a [len(indices), ...] tensor.

    `trim`: cut the batch to `batch_width` of its rows' lengths (`dataset.lengths`, `dataset.seq_len`); rows
    are right-padded and labels are -100 on padding, so the loss is the same, on fewer positions.
    `pack`: lay the samples end to end in rows of seq_len instead (`collate_packed`).
    A set that makes its own batches (pairs.PairRows, KtoRows: several rows per item) is asked for them.
    """
    if hasattr(dataset, "collate"):
        return dataset.collate(indices, trim, pack=pack)
    if pack:
        return collate_packed(dataset, indices)
    items = [dataset[i] for i in indices]
    batch = {key: torch.stack([item[key] for item in items]) for key in items[0]}
    if trim:
        width = batch_width(dataset.lengths[np.asarray(indices, dtype=np.int64)], dataset.seq_len)
        batch = {key: tensor[:, :width] for key, tensor in batch.items()}
    return batch


class BatchLoader:
    """Collates dataset items into micro-batches on the training device with a background prefetch.

    On CUDA: pinned host tensors and non-blocking copies; on CPU: plain tensors. The background thread
    only builds host tensors; the copy to the device is issued in `get`, on the caller's stream, so it
    is ordered with the compute that uses it. `prefetch` is how many micro-batches may load ahead of
    `get` (0: every batch loads inside `get`); either call order, prefetch(next) then get(current) or
    get(current) then prefetch(next), finds its batch ready. `trim`: batches are cut to their longest row
    (see `collate`); `pack_steps`: a batch's samples are laid end to end into micro_batch rows (`split`).
    """

    def __init__(self, dataset, device: torch.device, prefetch: int = 2, trim: bool = False, pack_steps: bool = False):
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        self.dataset = dataset
        self.trim = trim
        self.pack_steps = pack_steps
        self.device = torch.device(device)
        self.max_pending = prefetch
        self._pin = self.device.type == "cuda"
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memtrain-prefetch")
        self._pending: OrderedDict[tuple[int, ...], Future] = OrderedDict()

    def split(self, samples: list[int], micro_batch: int, count: int | None = None) -> list[list[int]]:
        """A step's samples (this rank's) in the micro-batches this loader makes of them, of `micro_batch` rows
        (`micro_batches_of`; `count` of them where steps are laid out packed and ranks must agree)."""
        return micro_batches_of(self.dataset, samples, micro_batch, self.pack_steps, count)

    def prefetch(self, indices: list[int]) -> None:
        """Start loading this micro-batch in a background thread (no-op when prefetch is 0 or already queued)."""
        key = tuple(indices)
        if self.max_pending == 0 or key in self._pending:
            return
        self._pending[key] = self._pool.submit(self._host_batch, key)
        # `prefetch` batches ahead plus the one a caller queued just before asking for it; beyond that the
        # oldest goes first, so batches never asked for (the micro-batch size changed) do not pile up.
        while len(self._pending) > self.max_pending + 1:
            _, stale = self._pending.popitem(last=False)
            stale.cancel()

    def get(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """The micro-batch for `indices` on the device: the prefetched one if queued, else loaded now."""
        key = tuple(indices)
        if key in self._pending:
            # Batches queued before this one were skipped and will not be asked for.
            while (oldest := next(iter(self._pending))) != key:
                self._pending.pop(oldest).cancel()
        future = self._pending.pop(key, None)
        batch = future.result() if future is not None else self._host_batch(key)
        if self.device.type == "cpu":
            return batch
        return {name: tensor.to(self.device, non_blocking=self._pin) for name, tensor in batch.items()}

    def close(self) -> None:
        """Drop queued batches and stop the background thread."""
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _host_batch(self, key: tuple[int, ...]) -> dict[str, torch.Tensor]:
        batch = collate(self.dataset, list(key), self.trim, pack=self.pack_steps)
        if self._pin:
            batch = {name: tensor.pin_memory() for name, tensor in batch.items()}
        return batch
