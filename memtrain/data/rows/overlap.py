"""Held-out records that training also holds: their prompts (and prompt + answer pairs) found in the training side.

A held-out score means little on questions the model was trained on (a file of a few records repeated scored
20/20 "held-out" answers, every one of them trained on), so the run counts them, and `data.validation_dedup` leaves
them out of validation. A record's keys are 64-bit hashes of its normalised text:
  prompt  the conversation before its last assistant message (what the generation eval prompts with), each
          message as its role and content;
  pair    the prompt and that last answer.
Normalised: Unicode NFKC, case folded, runs of whitespace as one space, ends stripped, so copies that differ in
case or spacing only are the same question. Keys are computed from the records (not the template's tokens), once
per version of a dataset's file and options: remembered beside the token cache (HELD_OUT_KEYS_DIR), 16 bytes per record,
so a large set is read again only when it changes. Conversation datasets only (completion, instruction, chat);
text has no questions, and preference and kto data are split elsewhere (pairs.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from memtrain.data.read.conversation import Message, to_conversation
from memtrain.data.read.records import dataset_fingerprint, read_records
from memtrain.data.tokens.cache import cache_dir_of
from memtrain.data.tokens.tokenized import SAMPLE_OPTIONS
from memtrain.errors import DataError
from memtrain.recipe.schema import DatasetSpec

# Bump when what a key covers (normalisation, the prompt's extent) changes, so remembered keys are not reused.
KEYS_VERSION = "1"
HELD_OUT_KEYS_DIR = "held-out-keys"  # under the token cache directory
NO_KEY = np.uint64(0)  # a record with no conversation (left out by data.skip_untrainable): matches nothing
CONVERSATION_TYPES = ("completion", "instruction", "chat")


@dataclass(frozen=True)
class RecordKeys:
    """One dataset's keys, by record position in read order (as mixture.py's `records` count them)."""

    prompt: np.ndarray  # uint64
    pair: np.ndarray  # uint64


@dataclass(frozen=True)
class HeldOutOverlap:
    """How many held-out samples of conversation datasets also occur in training, counted before
    data.validation_dedup drops any (`dropped`)."""

    samples: int  # held-out conversation samples compared
    prompts_in_train: int  # whose prompt training also holds
    answers_in_train: int  # whose prompt and answer training also holds
    dropped: int  # left out of validation by data.validation_dedup

    def describe(self) -> str:
        """'held-out: 5 of 20 prompts also in training (5 with the same answer)', with the dedup's count."""
        said = (
            f"held-out: {self.prompts_in_train} of {self.samples} prompts also in training "
            f"({self.answers_in_train} with the same answer)"
        )
        return said + (f", {self.dropped} left out of validation (data.validation_dedup)" if self.dropped else "")


def normalised(text: str) -> str:
    """`text` as keys compare it: NFKC, case folded, whitespace runs as one space, ends stripped."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def conversation_keys(messages: list[Message]) -> tuple[int, int]:
    """(prompt key, pair key) of a conversation: before its last assistant message, and with it."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        return int(NO_KEY), int(NO_KEY)
    prompt = "\x1e".join(f"{m['role']}\x1f{normalised(m['content'])}" for m in messages[:last])
    return _hash(prompt), _hash(f"{prompt}\x1d{normalised(messages[last]['content'])}")


def record_keys(spec: DatasetSpec, cache_dir: str | None) -> RecordKeys:
    """The keys of every record of a conversation dataset, remembered under the token cache per version of its
    file and options. Raises DataError as the readers do for a file that cannot be read."""
    memo_root = cache_dir_of(cache_dir)
    options = {name: getattr(spec, name) for name in SAMPLE_OPTIONS}
    identity = hashlib.sha256(
        "\0".join(
            (
                KEYS_VERSION,
                dataset_fingerprint(spec.path, spec.split, memo_root, spec.subset),
                json.dumps(options, sort_keys=True, default=str),
            )
        ).encode()
    ).hexdigest()
    memo = memo_root / HELD_OUT_KEYS_DIR / f"{identity}.npy"
    with contextlib.suppress(OSError, ValueError):
        both = np.load(memo)
        if both.dtype == np.uint64 and both.ndim == 2 and both.shape[0] == 2:
            return RecordKeys(both[0], both[1])
    prompt, pair = [], []
    for line, record in read_records(spec.path, spec.split, subset=spec.subset):
        try:
            keys = conversation_keys(to_conversation(record, spec, spec.path, line))
        except DataError:  # a record training left out (skip_untrainable): it is in neither split
            keys = (int(NO_KEY), int(NO_KEY))
        prompt.append(keys[0])
        pair.append(keys[1])
    both = np.array([prompt, pair], dtype=np.uint64).reshape(2, -1)
    _remember(memo, both)
    return RecordKeys(both[0], both[1])


def keys_of(spec: DatasetSpec, cache_dir: str | None, records: np.ndarray) -> RecordKeys:
    """The keys of the records at `records` (positions in read order); none for a dataset that is not a
    conversation one."""
    if spec.type not in CONVERSATION_TYPES:
        empty = np.zeros(0, dtype=np.uint64)
        return RecordKeys(empty, empty)
    keys = record_keys(spec, cache_dir)
    return RecordKeys(keys.prompt[records], keys.pair[records])


def in_training(held_out: RecordKeys, trained: RecordKeys) -> tuple[np.ndarray, np.ndarray]:
    """(prompt in training, prompt and answer in training): bool per held-out record; a record without a key
    matches nothing."""
    return (
        np.isin(held_out.prompt, trained.prompt) & (held_out.prompt != NO_KEY),
        np.isin(held_out.pair, trained.pair) & (held_out.pair != NO_KEY),
    )


def joined(keys: list[RecordKeys]) -> RecordKeys:
    """Several datasets' keys as one set (order kept)."""
    empty = np.zeros(0, dtype=np.uint64)
    return RecordKeys(
        np.concatenate([k.prompt for k in keys] or [empty]), np.concatenate([k.pair for k in keys] or [empty])
    )


def overlap_warning(overlap: HeldOutOverlap | None, dedup: bool) -> str | None:
    """A warning for people when held-out prompts also occur in training and stay in validation: the held-out loss
    and exact match then partly measure what was learnt by heart. None when none do (or they were left out)."""
    if overlap is None or dedup or not overlap.prompts_in_train:
        return None
    return (
        f"{overlap.prompts_in_train} of {overlap.samples} held-out prompts also occur in the training data "
        f"({overlap.answers_in_train} with the same answer): the validation loss and exact match on them measure "
        "what was trained on — set data.validation_dedup: true to leave them out of validation, or hold out "
        "records that training does not hold"
    )


def _hash(text: str) -> int:
    value = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
    return value or 1  # 0 is NO_KEY


def _remember(memo: Path, both: np.ndarray) -> None:
    """Best effort, whole or not at all: a cache that cannot be written only means reading the records again."""
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        handle, tmp = tempfile.mkstemp(dir=memo.parent, prefix=f".{memo.name}.", suffix=".npy")
    except OSError:
        return
    try:
        with os.fdopen(handle, "wb") as stream:
            np.save(stream, both)
        os.chmod(tmp, 0o644)  # as the cache's entries: other users of a shared cache read it too
        os.replace(tmp, memo)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
