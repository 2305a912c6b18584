"""Rows of seq_len tokens holding whole samples: the training items of instruction, chat and mixed data.

A sample is a view (source array, start, length) into a tokenised dataset. A row holds one sample
(unpacked) or several (packed, see packing.py) and becomes, in `__getitem__`:
  input_ids     the samples end to end, then pad_id up to seq_len;
  labels        the token where it is a target, else -100; always -100 on each sample's first token
                (nothing in the sample predicts it, and in a packed row the previous sample's last token
                must not be trained to predict it) and on padding;
  position_ids  0, 1, ... restarting at every sample, so each keeps the positions it has alone; padding
                continues the last sample's positions. transformers reads the restarts as sample
                boundaries and gives sdpa / eager / flex attention a block-diagonal causal mask
                (masking_utils.find_packed_sequence_indices); a row with one sample has no restart and
                keeps the plain causal kernels. See model/wrapper.py for flash attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from memtrain.data.rows.overlap import HeldOutOverlap
from memtrain.labels import IGNORE_INDEX


@dataclass(frozen=True)
class DataStats:
    """What became of the data: for logs, the planner and people checking their recipe."""

    samples: int  # samples in the rows (weights applied; repeats counted)
    truncated: int  # samples cut to seq_len (truncation: truncate); text pieces are not counted
    dropped_too_long: int  # samples left out for being longer than seq_len (truncation: drop)
    dropped_no_targets: int  # samples left out with no target token (e.g. a response truncated away)
    rows: int  # items of the dataset (rows of seq_len tokens)
    tokens: int  # real tokens in the rows
    target_tokens: int  # tokens the loss is computed on
    seq_len: int
    held_out: HeldOutOverlap | None = None  # held-out samples that training also holds; None where not counted

    @property
    def padding_share(self) -> float:
        """Share of the rows' token slots that are padding."""
        slots = self.rows * self.seq_len
        return 1 - self.tokens / slots if slots else 0.0

    def describe(self) -> str:
        return (
            f"{self.samples} samples in {self.rows} rows of {self.seq_len} tokens: {self.tokens} tokens, "
            f"{self.target_tokens} targets, {self.padding_share:.1%} padding; {self.truncated} truncated, "
            f"{self.dropped_too_long} too long and {self.dropped_no_targets} without targets left out"
            + (f"; {self.held_out.describe()}" if self.held_out is not None else "")
        )


PREFIX_CHUNK = 1 << 22  # elements summed at a time by prefix_sums: a 32 MB int64 temporary


def span_sums(values: np.ndarray, begin: np.ndarray, end: np.ndarray) -> np.ndarray:
    """values[begin[i]:end[i]].sum() for each i (0 <= begin <= end <= len(values)), as int64."""
    prefix = prefix_sums(values, np.concatenate([begin, end]))
    return prefix[len(begin) :] - prefix[: len(begin)]


def prefix_sums(values: np.ndarray, points: np.ndarray) -> np.ndarray:
    """values[:p].sum() for each p in `points` (0 <= p <= len(values)), as int64, a chunk at a time: a cumulative sum
    over the whole array (the token cache's target flags, memory-mapped) took 16 bytes per token at every start."""
    order = np.argsort(points, kind="stable")
    ordered = points[order]
    sums = np.zeros(len(points), dtype=np.int64)
    carry = 0
    for low in range(0, len(values), PREFIX_CHUNK):
        high = min(low + PREFIX_CHUNK, len(values))
        chunk = np.cumsum(values[low:high], dtype=np.int64)
        first, stop = np.searchsorted(ordered, [low, high], side="right")  # the points in (low, high]
        sums[first:stop] = carry + chunk[ordered[first:stop] - low - 1]
        carry += int(chunk[-1])
    out = np.empty(len(points), dtype=np.int64)
    out[order] = sums
    return out


@dataclass(frozen=True)
class SampleViews:
    """Samples as views into tokenised datasets: sample i is sources[source[i]] from start[i], length[i] tokens."""

    tokens: tuple[np.ndarray, ...]  # per source dataset
    targets: tuple[np.ndarray, ...]  # per source dataset, uint8 beside tokens
    source: np.ndarray  # int64 per sample
    start: np.ndarray  # int64 per sample
    length: np.ndarray  # int64 per sample

    def __len__(self) -> int:
        return len(self.start)

    def target_counts(self) -> np.ndarray:
        """Target tokens of each sample, its first token excluded (see the module doc)."""
        counts = np.zeros(len(self), dtype=np.int64)
        for s, targets in enumerate(self.targets):
            mine = np.flatnonzero(self.source == s)
            start, length = self.start[mine], self.length[mine]
            # an empty sample (a record data.skip_untrainable left out) has none; it may start past the last token
            counts[mine] = span_sums(targets, start + np.minimum(length, 1), start + length)
        return counts

    def take(self, indices) -> SampleViews:
        """The samples at `indices`, in that order (repeats allowed)."""
        indices = np.asarray(indices, dtype=np.int64)
        return SampleViews(self.tokens, self.targets, self.source[indices], self.start[indices], self.length[indices])

    @staticmethod
    def concat(parts: list[SampleViews]) -> SampleViews:
        """The samples of every part, in order, over the union of their sources."""
        offsets = np.cumsum([0] + [len(p.tokens) for p in parts])
        return SampleViews(
            tokens=tuple(t for p in parts for t in p.tokens),
            targets=tuple(t for p in parts for t in p.targets),
            source=np.concatenate([p.source + o for p, o in zip(parts, offsets)]).astype(np.int64),
            start=np.concatenate([p.start for p in parts]).astype(np.int64),
            length=np.concatenate([p.length for p in parts]).astype(np.int64),
        )


class SampleRows(torch.utils.data.Dataset):
    """Item i is {"input_ids", "labels", "position_ids"}: LongTensor[seq_len] each, row i's samples (module doc).

    `rows` is a list of sample-index lists into `samples`; every row's lengths sum to at most seq_len.
    """

    def __init__(
        self, samples: SampleViews, rows: list[list[int]], seq_len: int, pad_id: int, stats: DataStats | None = None
    ):
        self.samples = samples
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.row_starts = np.cumsum([0] + [len(r) for r in rows], dtype=np.int64)
        self.row_samples = np.asarray([i for r in rows for i in r], dtype=np.int64)
        lengths = np.add.reduceat(samples.length[self.row_samples], self.row_starts[:-1]) if rows else np.zeros(0)
        if len(rows) and (min(len(r) for r in rows) < 1 or lengths.max() > seq_len):
            raise ValueError(f"every row needs one or more samples of at most {seq_len} tokens in all")
        per_sample = samples.target_counts()
        self.row_tokens = np.asarray(lengths, dtype=np.int64)
        self.row_targets = (
            np.add.reduceat(per_sample[self.row_samples], self.row_starts[:-1]) if rows else np.zeros(0, dtype=np.int64)
        )
        self.stats = stats

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    @property
    def lengths(self) -> np.ndarray:
        """Real tokens of each row (padding follows them), as TokenWindows.lengths: what bucketing sorts by."""
        return self.row_tokens

    @property
    def n_tokens(self) -> int:
        """Real (non-padding) tokens over all rows."""
        return int(self.row_tokens.sum())

    def targets(self, indices) -> int:
        """Target tokens the loss sees for the rows at `indices` (labels[1:] != -100 per row, summed)."""
        return int(self.row_targets[np.asarray(indices, dtype=np.int64)].sum())

    def target_tokens(self, indices) -> int:
        """Target tokens of the items at `indices`: what `targets` normalises the loss by (pair sets differ)."""
        return self.targets(indices)

    def tokens_of(self, indices) -> int:
        """Real (non-padding) tokens of the items at `indices`, as pair sets count theirs."""
        return int(self.lengths[np.asarray(indices, dtype=np.int64)].sum())

    def row(self, index: int) -> list[int]:
        """The sample indices in row `index`."""
        return self.row_samples[self.row_starts[index] : self.row_starts[index + 1]].tolist()

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} out of range for {len(self)} rows")
        index %= len(self)
        input_ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        position_ids = np.zeros(self.seq_len, dtype=np.int64)
        s = self.samples
        at = 0
        for i in self.row(index):
            source, start, length = int(s.source[i]), int(s.start[i]), int(s.length[i])
            ids = s.tokens[source][start : start + length].astype(np.int64)  # uint16 would wrap -100
            input_ids[at : at + length] = ids
            labels[at : at + length] = np.where(s.targets[source][start : start + length] != 0, ids, IGNORE_INDEX)
            labels[at] = IGNORE_INDEX
            position_ids[at : at + length] = np.arange(length)
            at += length
        position_ids[at:] = np.arange(position_ids[at - 1] + 1, position_ids[at - 1] + 1 + self.seq_len - at)
        return {
            "input_ids": torch.from_numpy(input_ids),
            "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(position_ids),
        }

    def select(self, indices) -> SampleRows:
        """The rows at `indices` (in that order), sharing the samples; stats are not carried over."""
        return SampleRows(
            self.samples, [self.row(int(i)) for i in np.asarray(indices, dtype=np.int64)], self.seq_len, self.pad_id
        )
