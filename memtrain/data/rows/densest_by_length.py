"""The densest row a training set would have at every shorter data.seq_len, from one set built at the longest:
what `memtrain plan --max-seq-len --data` prices the attention backward by at each length it plans.

The set is built once (the data tokenised once), at the longest length the search may try and with one sample a
row. A sample longer than that length is already truncated to it or left out, as it would be at every shorter
length, so each sample's token count is as long as any length needs. Each length then fits the samples again and
lays them out as the data code does at that length:
  instruction and chat samples   truncated or left out (data.truncation), a text dataset's documents cut into
                                 pieces, rows packed where data.packing (loader.densest_row_at);
  preference pairs               cut as pairs.fit cuts them (the prompt's start, then the answer's end), or left out
                                 with data.truncation drop; each pair's two sequences laid out in twice seq_len;
  KTO records                    truncated or left out, one a row (their rows are never packed).
What a shorter length does not redo: the held-out tail and the weights are drawn from the samples usable at the
longest length (with truncation drop, fewer are usable at a shorter one, so the tail's boundary moves by a few), and
a sample truncated so short that no target is left is still counted. A document longer than the longest length is
counted in pieces of that length, each cut again.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from memtrain.data.rows.loader import densest_row, densest_row_at, packing_units, rows_at
from memtrain.data.rows.mixture import document_samples
from memtrain.data.rows.pairs import PairRows, fit, prompt_lengths
from memtrain.data.rows.row_set import SampleRows
from memtrain.recipe.schema import Data


def densest_row_by_length(train_set, data: Data) -> Callable[[int], int]:
    """seq_len -> the most samples one row of the training data holds at that length (`densest_row_samples` of the
    set built at it). train_set: the training set built at the longest length asked for, data.packing off (one
    sample a row); data: the recipe's data section (its packing and truncation)."""
    if isinstance(train_set, SampleRows):
        count = _samples(train_set, data)
    elif isinstance(train_set, PairRows):
        count = _pairs(train_set, data.truncation)
    else:  # KTO records (TokenWindows have one sequence a row at any length)
        lengths, _ = packing_units(train_set)
        count = lambda seq_len: densest_row_at(lengths, seq_len, truncation=data.truncation, packing=False)
    counted: dict[int, int] = {}

    def at(seq_len: int) -> int:
        if seq_len not in counted:
            counted[seq_len] = count(seq_len)
        return counted[seq_len]

    return at


def rows_by_length(train_set, data: Data) -> Callable[[int], int]:
    """seq_len -> the rows the training data makes at that length (what batch.global_batch counts): instruction, chat
    and text-list data fitted and packed as `densest_row_by_length` does; a pair or KTO record is one row, kept at any
    length with truncation truncate, left out where its longer sequence is over the length with drop."""
    if isinstance(train_set, SampleRows):
        samples, documents = _sample_tokens(train_set, data)
        return lambda seq_len: rows_at(
            samples, seq_len, truncation=data.truncation, packing=data.packing, documents=documents
        )
    if isinstance(train_set, PairRows):
        longer = np.maximum(train_set.views["chosen"].length, train_set.views["rejected"].length)
    else:
        longer, _ = packing_units(train_set)
    longer = np.asarray(longer, dtype=np.int64)
    if data.truncation != "drop":
        return lambda seq_len: len(longer)
    return lambda seq_len: int(np.count_nonzero(longer <= seq_len))


def _samples(train_set: SampleRows, data: Data) -> Callable[[int], int]:
    samples, documents = _sample_tokens(train_set, data)
    return lambda seq_len: densest_row_at(
        samples, seq_len, truncation=data.truncation, packing=data.packing, documents=documents
    )


def _sample_tokens(train_set: SampleRows, data: Data) -> tuple[np.ndarray, np.ndarray]:
    """(instruction and chat samples' token counts, text documents' token counts) of a set of one sample a row."""
    if len(train_set.samples) != len(train_set):
        raise ValueError("the training set must hold one sample a row (built with data.packing off)")
    tokens = train_set.samples.length
    pieces = document_samples(data, train_set)
    return tokens[~pieces], tokens[pieces]


def _pairs(pairs: PairRows, truncation: str) -> Callable[[int], int]:
    """As pairs._pairs fits a pair at a length: cut against its longer sequence (prompts read only where it is cut,
    once each), or left out with truncation drop; then laid out in twice the length (PairRows.packing_units)."""
    chosen, rejected = pairs.views["chosen"], pairs.views["rejected"]
    prompts = np.full((2, len(pairs)), -1, dtype=np.int64)  # -1: not read yet

    def count(seq_len: int) -> int:
        c, r = chosen.length, rejected.length
        too_long = np.maximum(c, r) > seq_len
        if truncation == "drop":
            return densest_row((c + r)[~too_long], 2 * seq_len)
        unread = np.flatnonzero(too_long & (prompts[0] < 0))
        prompts[0, unread], prompts[1, unread] = (
            prompt_lengths(chosen.take(unread)),
            prompt_lengths(rejected.take(unread)),
        )
        pc, pr = np.where(too_long, prompts[0], c), np.where(too_long, prompts[1], r)
        (kept_c, kept_r), (answer_c, answer_r) = fit([pc, pr], [c - pc, r - pr], seq_len)
        return densest_row(kept_c + answer_c + kept_r + answer_r, 2 * seq_len)

    return count
