"""Training samples: fixed-length token windows over the cached token stream, and the train/validation split.

`build_datasets` is the entry point for both kinds of data: a path in data.train is text, cut into these
windows; a list of datasets (instruction, chat, ...) becomes rows of whole samples (mixture.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from memtrain.data.rows.mixture import build_rows, validation_rows
from memtrain.data.rows.pairs import KtoRows, PairRows, build_pair_sets, pair_validation_set
from memtrain.data.rows.pieces import cut_documents
from memtrain.data.rows.row_set import DataStats, SampleRows
from memtrain.data.tokens.cache import cached_documents
from memtrain.errors import DataError, Problem
from memtrain.labels import IGNORE_INDEX
from memtrain.recipe.schema import Data


class TokenWindows(torch.utils.data.Dataset):
    """Samples of exactly `seq_len` tokens, each a slice `tokens[start : start + length]` right-padded.

    Item i is {"input_ids": LongTensor[seq_len], "labels": LongTensor[seq_len]}: labels equal input_ids
    (the model shifts them) except on padding, where they are -100. No attention mask is needed:
    padding only follows real tokens, and causal attention never lets a real token see it.
    Build one with `packed_windows` or `document_windows`; `select` takes a subset.
    """

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, seq_len: int, pad_id: int):
        if len(starts) != len(lengths):
            raise ValueError("starts and lengths must have the same length")
        if len(lengths) and (lengths.min() < 1 or lengths.max() > seq_len):
            raise ValueError(f"window lengths must lie in 1..{seq_len}")
        self.tokens = tokens
        self.starts = np.asarray(starts, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.seq_len = seq_len
        self.pad_id = pad_id

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def n_tokens(self) -> int:
        """Real (non-padding) tokens over all windows: the positions whose label is not -100."""
        return int(self.lengths.sum())

    @property
    def stats(self) -> DataStats:
        """The windows as DataStats (each window is a row; text has no truncation to report)."""
        return DataStats(
            samples=len(self),
            truncated=0,
            dropped_too_long=0,
            dropped_no_targets=0,
            rows=len(self),
            tokens=self.n_tokens,
            target_tokens=int((self.lengths - 1).sum()),
            seq_len=self.seq_len,
        )

    def targets(self, indices) -> int:
        """Target tokens the loss sees for the windows at `indices`: labels[1:] != -100, i.e. length - 1 each."""
        return int((self.lengths[np.asarray(indices, dtype=np.int64)] - 1).sum())

    def target_tokens(self, indices) -> int:
        """Target tokens of the items at `indices`: what `targets` normalises the loss by (pair sets differ)."""
        return self.targets(indices)

    def tokens_of(self, indices) -> int:
        """Real (non-padding) tokens of the items at `indices`, as pair sets count theirs."""
        return int(self.lengths[np.asarray(indices, dtype=np.int64)].sum())

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        start, length = int(self.starts[index]), int(self.lengths[index])
        input_ids = torch.full((self.seq_len,), self.pad_id, dtype=torch.long)
        input_ids[:length] = torch.from_numpy(self.tokens[start : start + length].astype(np.int64))
        labels = input_ids.clone()
        labels[length:] = IGNORE_INDEX
        return {"input_ids": input_ids, "labels": labels}

    def select(self, indices) -> TokenWindows:
        """The windows at `indices` (in that order), sharing the token array."""
        indices = np.asarray(indices, dtype=np.int64)
        return TokenWindows(self.tokens, self.starts[indices], self.lengths[indices], self.seq_len, self.pad_id)


def packed_windows(tokens: np.ndarray, seq_len: int, pad_id: int) -> TokenWindows:
    """Consecutive non-overlapping windows of `seq_len` tokens; the last len(tokens) % seq_len tokens are dropped."""
    n_windows = len(tokens) // seq_len
    starts = np.arange(n_windows, dtype=np.int64) * seq_len
    return TokenWindows(tokens, starts, np.full(n_windows, seq_len, dtype=np.int64), seq_len, pad_id)


def document_windows(tokens: np.ndarray, doc_ends: np.ndarray, seq_len: int, pad_id: int) -> TokenWindows:
    """Each document (with its eos) cut into windows of `seq_len` tokens, the last one padded, as a text dataset
    of a list cuts it: nothing is dropped (one window per document, cut to seq_len, would train a .txt file's
    first seq_len tokens alone). A last piece of one token, which holds no target, is left out."""
    ends = np.asarray(doc_ends, dtype=np.int64)
    starts = np.concatenate([np.zeros(1, dtype=np.int64), ends[:-1]]) if len(ends) else ends
    _, window_starts, window_lengths = cut_documents(starts, ends - starts, seq_len)
    keep = window_lengths > 1
    return TokenWindows(tokens, window_starts[keep], window_lengths[keep], seq_len, pad_id)


def build_datasets(
    data: Data, tokenizer: PreTrainedTokenizerBase, seed: int
) -> (
    tuple[TokenWindows, TokenWindows]
    | tuple[SampleRows, SampleRows]
    | tuple[PairRows, PairRows]
    | tuple[KtoRows, KtoRows]
):
    """(train, validation) samples for the recipe's data section.

    Preference and kto datasets give `PairRows` / `KtoRows` (pairs.build_pair_sets): what a preference objective
    trains on, a pair being one sample.

    A list of datasets in data.train gives `SampleRows` (see mixture.build_rows; `seed` chooses the
    weighted subsets and the row order). A path gives text windows, as follows.
    Validation comes from `data.validation` when given; otherwise it is the last
    max(1, round(validation_fraction * n)) training windows: a contiguous tail rather than a random
    draw, because neighbouring windows of one passage would leak validation text into training.
    `seed` therefore does not change the split (`SampleOrder` shuffles the training order).
    Raises `DataError` when the data gives no window or too few to hold one out.
    """
    if data.holds_pairs:  # preference or kto records: pairs of sequences (pairs.py)
        return build_pair_sets(data, tokenizer, seed)
    if not isinstance(data.train, str):
        return build_rows(data, tokenizer, seed)
    windows = _windows(data, data.train, "data.train", tokenizer)
    if data.validation is not None:
        return windows, _windows(data, data.validation, "data.validation", tokenizer)
    n_windows = len(windows)
    n_validation = held_out_windows(n_windows, data)
    if n_windows - n_validation < 1:
        raise DataError(
            Problem(
                f"{data.train} gives {n_windows} window(s) of {data.seq_len} tokens, too few to hold "
                f"{n_validation} out for validation and train on the rest",
                key="data.train",
                file=data.train,
                hint="set data.validation to a separate file, lower data.seq_len, or add text",
            )
        )
    boundary = n_windows - n_validation
    return windows.select(np.arange(boundary)), windows.select(np.arange(boundary, n_windows))


def held_out_windows(n_windows: int, data: Data) -> int:
    """The training windows' tail held out for validation where data.validation names no file of its own: at least
    one, data.validation_fraction of them (0 where data.validation is given)."""
    if data.validation is not None:
        return 0
    return max(1, round(data.validation_fraction * n_windows))


def text_rows_by_length(data: Data, tokenizer: PreTrainedTokenizerBase) -> Callable[[int], int]:
    """seq_len -> the training windows data.train's text gives at that length, its held-out tail left out (what
    batch.global_batch counts); the text is read (tokenised into the cache) once, here."""
    tokens, doc_ends = cached_documents(data.train, data.format, data.field, tokenizer, data.cache_dir)

    def at(seq_len: int) -> int:
        windows = len(text_windows(tokens, doc_ends, seq_len, data.packing, pad_id=0))
        return max(0, windows - held_out_windows(windows, data))

    return at


def text_windows(tokens: np.ndarray, doc_ends: np.ndarray, seq_len: int, packing: bool, pad_id: int) -> TokenWindows:
    """A text's windows: end to end across documents where data.packing (`packed_windows`), else each document cut
    into its own (`document_windows`)."""
    if packing:
        return packed_windows(tokens, seq_len, pad_id)
    return document_windows(tokens, doc_ends, seq_len, pad_id)


def build_validation(data: Data, tokenizer: PreTrainedTokenizerBase, seed: int) -> TokenWindows | SampleRows:
    """build_datasets' validation samples; where data.validation names files of its own, data.train's are not read
    (`memtrain eval` of a run must not fail when its training file has moved: it scores none of it)."""
    if data.validation is None:
        return build_datasets(data, tokenizer, seed)[1]
    if isinstance(data.train, str):
        return _windows(data, data.validation, "data.validation", tokenizer)
    if data.holds_pairs:
        return pair_validation_set(data, tokenizer, seed)
    return validation_rows(data, tokenizer, seed)


def _windows(data: Data, spec: str, key: str, tokenizer: PreTrainedTokenizerBase) -> TokenWindows:
    tokens, doc_ends = cached_documents(spec, data.format, data.field, tokenizer, data.cache_dir)
    windows = text_windows(tokens, doc_ends, data.seq_len, data.packing, tokenizer.pad_token_id)
    if len(windows) == 0:
        raise DataError(
            Problem(
                f"{spec} has {len(tokens)} tokens, fewer than one seq_len window of {data.seq_len}",
                key=key,
                file=spec,
                hint="lower data.seq_len or add text",
            )
        )
    return windows
