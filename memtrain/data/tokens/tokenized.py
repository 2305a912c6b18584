"""One dataset of a recipe's list, tokenised: every sample's token ids and target flags, cached on disk.

A cache entry is three .npy files per key: `<key>.ends.npy` (each sample's end offset), `<key>.targets.npy`
(uint8, 1 where the token is a target) and `<key>.tokens.npy`, written in that order, each atomically, then the
record of their sizes and checksums (cache.write_entry), the sign that an entry is complete and checked before it is
used: a damaged entry is tokenised again. The key covers the data's bytes, the dataset's
options (type, field names, roles, split), the tokenizer, and for conversations the template and the
target policy. seq_len, truncation, weights and packing are not in it: they are applied to the cached
samples when the dataset is assembled (mixture.py), so changing them re-tokenises nothing.
Nothing is written unless every record of the dataset turned into a sample.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

from memtrain.data.read.conversation import (
    Untrainable,
    document_text,
    to_conversation,
    unread_system_field,
)
from memtrain.data.read.corpus import read_documents
from memtrain.data.read.preference import to_kto, to_pair
from memtrain.data.read.problems import FileProblems
from memtrain.data.read.records import dataset_fingerprint, read_records, record_format
from memtrain.data.render.chat import CHAT_ENCODING_VERSION, ConversationEncoder
from memtrain.data.render.pairs import PairEncoder
from memtrain.data.render.templates import ChatTemplate
from memtrain.data.tokens.cache import cache_dir_of, token_dtype, verified_entry, write_entry
from memtrain.data.tokens.long_text import encode_documents
from memtrain.data.tokens.parallel import map_batches
from memtrain.data.tokens.progress import report
from memtrain.data.tokens.tokenizer import tokenizer_fingerprint
from memtrain.errors import DataError, Problem
from memtrain.recipe.schema import PAIR_TYPES, DatasetSpec

# Bump when the layout or the rules that make samples change, so old entries are not reused.
TOKENIZED_VERSION = "1"
# Records rendered and tokenised per tokenizer call.
BATCH_RECORDS = 512
# Options of a DatasetSpec that change the samples (weight only changes how often they are used).
SAMPLE_OPTIONS = (
    "type",
    "split",
    "field",
    "prompt_field",
    "completion_field",
    "instruction_field",
    "input_field",
    "output_field",
    "system_field",
    "messages_field",
    "chat_format",
    "roles",
    "chosen_field",
    "rejected_field",
    "label_field",
)
# How preference and kto records become samples (render/pairs.py); part of their cache key.
PAIR_ENCODING_VERSION = "1"


@dataclass(frozen=True)
class Tokenized:
    """Samples end to end: sample i is tokens[ends[i-1]:ends[i]], with targets (0/1) beside its tokens."""

    tokens: np.ndarray  # uint16 or uint32
    targets: np.ndarray  # uint8
    ends: np.ndarray  # int64, one per sample
    # conversations whose template did not write some of their messages, by the role of those messages, with the
    # first such record's line: {"system": [count, line]} (Mistral's template writes a system message only into a
    # conversation's last user turn, so never into one that ends with an answer)
    unwritten: dict[str, list[int]] = field(default_factory=dict)
    # conversations with a user or system message after their last assistant message (context no answer follows),
    # as [count, the first one's line]; empty when none
    trailing: list[int] = field(default_factory=list)
    # records with nothing to train on left out (data.skip_untrainable) as [count, the first one's line]: each is an
    # empty sample, so that sample i is still record i
    skipped: list[int] = field(default_factory=list)
    # records with a system prompt in a field the dataset does not read (conversation.unread_system_field), by that
    # field: {"system": [count, the first one's line]}; entries written before it was counted have none
    unread_system: dict[str, list[int]] = field(default_factory=dict)
    # preference records whose chosen and rejected answers are the same tokens, as [count, the first one's line]
    identical: list[int] = field(default_factory=list)
    # kto: uint8 per record (= per sample), 1 where the completion is desirable; None for other types
    desirable: np.ndarray | None = None

    @property
    def starts(self) -> np.ndarray:
        return np.concatenate([np.zeros(1, dtype=np.int64), self.ends[:-1]]) if len(self.ends) else self.ends


# The notes of an entry (Tokenized's fields after its arrays), kept beside it in `<key>.notes.json`.
NOTES = ("unwritten", "trailing", "skipped", "unread_system", "identical")
# The arrays of an entry, in the order they are written: tokens last, its presence marking a complete entry.
ARRAYS = ("ends", "targets", "tokens")
KTO_ARRAYS = ("ends", "targets", "desirable", "tokens")


@dataclass(frozen=True)
class SampleRules:
    """How records become samples, beyond the dataset's own options: the same for every dataset of a recipe."""

    template: ChatTemplate | None  # None for text datasets
    train_on_inputs: bool = False
    train_on: str = "all_turns"
    skip_untrainable: bool = False

    def fingerprint(self) -> str:
        if self.template is None:
            return "text"
        t = self.template
        return json.dumps(
            [
                CHAT_ENCODING_VERSION,
                t.name,
                t.source,
                t.special_tokens,
                t.end_of_turn,
                self.train_on_inputs,
                self.train_on,
                *(["skip_untrainable"] if self.skip_untrainable else []),
            ]
        )


def tokenized_dataset(
    spec: DatasetSpec, tokenizer: PreTrainedTokenizerBase, rules: SampleRules, cache_dir: str | None
) -> Tokenized:
    """The samples of `spec`, from the cache when present, else tokenised now and stored (see module doc).

    Raises DataError for unreadable data or bad records (reported together: data/read/problems.py), UserError
    when the cache directory cannot be written.
    """
    directory = cache_dir_of(cache_dir)
    key = _cache_key(spec, tokenizer, rules, directory)
    paths = {name: directory / f"{key}.{name}.npy" for name in (KTO_ARRAYS if spec.type == "kto" else ARRAYS)}
    notes = directory / f"{key}.notes.json"
    cached = _load(paths, notes)
    if cached is not None:
        return cached
    samples = tokenize_dataset(spec, tokenizer, rules)
    said = {name: getattr(samples, name) for name in NOTES if getattr(samples, name)}  # none: no notes file
    # tokens last: its presence marks a complete entry
    write_entry(
        [
            *([(notes, json.dumps(said))] if said else []),
            *[(path, getattr(samples, name)) for name, path in paths.items()],
        ]
    )
    return _load(paths, notes) or samples


def tokenize_dataset(spec: DatasetSpec, tokenizer: PreTrainedTokenizerBase, rules: SampleRules) -> Tokenized:
    """Tokenise every record of `spec` (no cache): documents for text, rendered conversations otherwise."""
    if spec.type == "text":
        pieces, said = _document_samples(spec, tokenizer), {}
    elif spec.type in PAIR_TYPES:
        pieces, said = pair_samples(spec, PairEncoder(tokenizer, rules.template))
    else:
        if rules.template is None:
            raise ValueError(f"{spec.type} datasets need a chat template")
        encoder = ConversationEncoder(
            tokenizer, rules.template, train_on_inputs=rules.train_on_inputs, train_on=rules.train_on
        )
        pieces, said = _conversation_samples(spec, encoder, rules.skip_untrainable)
    if not pieces:
        raise DataError(Problem("the dataset has no records", file=spec.path, hint="check the path and the file"))
    skipped = said.get("skipped")
    if skipped and skipped[0] == len(pieces):
        raise DataError(
            Problem(
                f"every record of the dataset ({len(pieces)}) has nothing to train on (no assistant "
                f"message, or an empty answer; the first at line {skipped[1]}), so all were left out",
                file=spec.path,
                key="data.skip_untrainable",
                hint="check the dataset's type and field names (output_field, completion_field, "
                "messages_field, roles:) against the records",
            )
        )
    lengths = np.fromiter((len(ids) for ids, _ in pieces), dtype=np.int64, count=len(pieces))
    tokens = np.concatenate([ids for ids, _ in pieces])  # already token_dtype's: no whole uint32 copy
    targets = np.concatenate([flags for _, flags in pieces])
    return Tokenized(tokens=tokens, targets=targets, ends=np.cumsum(lengths), **said)


def pair_samples(spec: DatasetSpec, encoder: PairEncoder) -> tuple[list[Piece], dict]:
    """The samples of a preference dataset (record i: sample 2i its prompt with the chosen answer, 2i + 1 with the
    rejected one) or a kto dataset (record i: sample i), with their notes: the preference records whose two answers
    are the same tokens (identical) and the kto labels (desirable). Bad records are problems at their line, said
    together before any is tokenised, as for conversations."""
    read = to_pair if spec.type == "preference" else to_kto
    records = _check(spec, lambda record, line: read(record, spec, spec.path, line))

    def sequences(record) -> list:
        if spec.type == "preference":
            return [(record.prompt, record.chosen), (record.prompt, record.rejected)]
        return [(record.prompt, record.completion)]

    dtype = token_dtype(encoder.tokenizer)
    out: list[Piece] = []
    identical: list[int] = []
    desirable: list[int] = []
    unwritten: dict[str, list[int]] = {}
    problems = FileProblems(spec.path)
    what = f"tokenising {Path(spec.path).name}"
    converted = _converted(spec, lambda record, line: (line, read(record, spec, spec.path, line)), problems)
    done = 0
    report(what, done, records)
    with contextlib.closing(
        map_batches(
            lambda batch: encoder.encode_many([s for _, record in batch for s in sequences(record)]),
            _batched(converted, BATCH_RECORDS),
            -(-records // BATCH_RECORDS),
        )
    ) as encoded_batches:
        for batch, encoded in encoded_batches:
            results = iter(encoded)
            for line, record in batch:
                mine = [next(results) for _ in sequences(record)]
                failed = next((r for r in mine if isinstance(r, Exception)), None)
                if failed is not None:
                    problems.add(
                        Problem(
                            str(failed),
                            file=spec.path,
                            line=line,
                            key="data.template",
                            hint="fix the record, or pick a template that can write it",
                        )
                    )
                    continue
                out += [_piece(r.ids, r.targets, dtype) for r in mine]
                if spec.type == "preference" and mine[0].ids == mine[1].ids:
                    _count(identical, line)
                if spec.type == "kto":
                    desirable.append(int(record.desirable))
                prompt = record.prompt
                for role in {prompt[i]["role"] for r in mine for i in r.unwritten if i < len(prompt)}:
                    _count(unwritten.setdefault(role, []), line)
            done += len(batch)
            report(what, done, records)
            if problems.full and done < records:
                problems.stop_after(batch[-1][0])
                break
    problems.raise_if_any()
    said: dict = {"identical": identical, "unwritten": unwritten}
    if spec.type == "kto":
        said["desirable"] = np.asarray(desirable, dtype=np.uint8)
    return out, said


# ---------------------------------------------------------------- documents and conversations


# A sample while a dataset is tokenised: (token ids as token_dtype, target flags as uint8); arrays, not lists of
# Python ints, which would take ten times the memory.
Piece = tuple[np.ndarray, np.ndarray]


def _piece(ids: list[int], flags: list[bool], dtype: type) -> Piece:
    return np.asarray(ids, dtype=dtype), np.asarray(flags, dtype=np.uint8)


def _document_samples(spec: DatasetSpec, tokenizer: PreTrainedTokenizerBase) -> list[Piece]:
    """Each non-empty document with an eos after it, every token a target (as the text path trains)."""
    if record_format(spec.path) == "text":
        documents = list(read_documents(spec.path, "text"))
    else:
        documents = _collect(spec, lambda record, line: document_text(record, spec, spec.path, line))
    eos = np.asarray([tokenizer.eos_token_id], dtype=token_dtype(tokenizer))
    return [
        (np.concatenate([ids.astype(eos.dtype), eos]), np.ones(len(ids) + 1, dtype=np.uint8))
        for ids in encode_documents((d for d in documents if d), tokenizer, f"tokenising {Path(spec.path).name}")
    ]


def _conversation_samples(
    spec: DatasetSpec, encoder: ConversationEncoder, skip_untrainable: bool = False
) -> tuple[list[Piece], dict]:
    """The samples and their notes (NOTES, as Tokenized's fields): the conversations whose template left messages
    out (unwritten), those that go on past their last answer (trailing), the records left out with nothing to
    train on (skipped; with `skip_untrainable`, else such a record is a problem), and those with a system prompt
    the dataset does not read (unread_system)."""
    unread_system: dict[str, list[int]] = {}

    def convert(record: dict, line: int) -> tuple[int, list | None]:
        try:
            return line, to_conversation(record, spec, spec.path, line)
        except Untrainable:
            if not skip_untrainable:
                raise
            return line, None

    def check(record: dict, line: int) -> tuple[int, list | None]:
        unread = unread_system_field(record, spec)
        if unread is not None:
            _count(unread_system.setdefault(unread, []), line)
        return convert(record, line)

    # Two reads: the first checks every record and keeps none, so a bad field anywhere is said before any
    # tokenising; the second streams batches to the encoders, so the parsed records (about 8 bytes of Python
    # objects per byte of the file: benchmarks/tokenize.csv) are never all in memory at once.
    records = _check(spec, check)
    dtype = token_dtype(encoder.tokenizer)
    out: list[Piece] = []
    unwritten: dict[str, list[int]] = {}
    trailing: list[int] = []
    skipped: list[int] = []
    problems = FileProblems(spec.path)
    what = f"tokenising {Path(spec.path).name}"
    batches = _batched(_converted(spec, convert, problems), BATCH_RECORDS)
    done = 0
    report(what, done, records)
    with contextlib.closing(
        map_batches(
            lambda batch: encoder.encode_many([m for _, m in batch if m is not None]),
            batches,
            -(-records // BATCH_RECORDS),
        )
    ) as encoded_batches:
        for batch, encoded in encoded_batches:  # closing: a stop ends the workers
            results = iter(encoded)
            for line, messages in batch:
                if messages is None:  # an empty sample: sample i stays record i (mixture.held_out_records)
                    out.append(_piece([], [], dtype))
                    _count(skipped, line)
                    continue
                result = next(results)
                if isinstance(result, Exception):
                    problems.add(
                        Problem(
                            str(result),
                            file=spec.path,
                            line=line,
                            key="data.template",
                            hint="fix the record, or pick a template that can write it",
                        )
                    )
                    continue
                out.append(_piece(result.ids, result.targets, dtype))
                for role in {messages[i]["role"] for i in result.unwritten}:
                    _count(unwritten.setdefault(role, []), line)
                if messages[-1]["role"] != "assistant":
                    _count(trailing, line)
            done += len(batch)
            report(what, done, records)
            if problems.full and done < records:  # said now, not after tokenising the rest (minutes for large data)
                problems.stop_after(batch[-1][0])
                break
    problems.raise_if_any()
    return out, {"unwritten": unwritten, "trailing": trailing, "skipped": skipped, "unread_system": unread_system}


def _count(noted: list[int], line: int) -> None:
    """One more record into a note of [count, the first one's line] (Tokenized.unwritten, trailing, skipped)."""
    noted[:] = [noted[0] + 1, noted[1]] if noted else [1, line]


def _converted(spec: DatasetSpec, convert, problems: FileProblems) -> Iterator:
    """convert(record, line) for each record it converts; the problems of the others and of the file's lines
    (invalid JSON, a damaged file) added to `problems`."""
    try:
        for line, record in read_records(spec.path, spec.split, problems, spec.subset):
            try:
                converted = convert(record, line)
            except DataError as err:
                problems.add(*err.problems)
                continue
            yield converted
    except DataError as err:  # the file could not be read on (damaged): said after what came before it
        problems.add(*err.problems)


def _collect(spec: DatasetSpec, convert) -> list:
    """convert(record, line) for every record; the problems of bad records and of the file's lines (invalid
    JSON) raised together, in line order."""
    problems = FileProblems(spec.path)
    out = list(_converted(spec, convert, problems))
    problems.raise_if_any()
    return out


def _check(spec: DatasetSpec, convert) -> int:
    """How many records there are, each converted and let go; problems raised as `_collect` raises them."""
    problems = FileProblems(spec.path)
    records = sum(1 for _ in _converted(spec, convert, problems))
    problems.raise_if_any()
    return records


def _batched(items: Iterator, size: int) -> Iterator[list]:
    """Lists of `size` items (the last may be shorter), read from `items` as they are asked for."""
    while batch := list(itertools.islice(items, size)):
        yield batch


# ---------------------------------------------------------------- cache


def _cache_key(spec: DatasetSpec, tokenizer: PreTrainedTokenizerBase, rules: SampleRules, directory: Path) -> str:
    options = json.dumps({name: getattr(spec, name) for name in SAMPLE_OPTIONS}, sort_keys=True)
    template = rules.fingerprint() if spec.type != "text" else "text"
    if spec.type in PAIR_TYPES:
        template += f"\0pairs:{PAIR_ENCODING_VERSION}"
    parts = (
        TOKENIZED_VERSION,
        dataset_fingerprint(spec.path, spec.split, directory, spec.subset),
        options,
        template,
        tokenizer_fingerprint(tokenizer),
    )
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _load(paths: dict[str, Path], notes: Path) -> Tokenized | None:
    """The entry memory-mapped, or None when it is missing or damaged (disk full, manual edits): its files must be
    those its record of checksums lists (cache.verified_entry, which says so when they are not)."""
    if not verified_entry(list(paths.values())):
        return None
    try:
        arrays = {name: np.load(path, mmap_mode="r") for name, path in paths.items()}
        if "desirable" in arrays:  # one label per kto record
            said_desirable = {"desirable": np.asarray(arrays.pop("desirable"))}
            if len(said_desirable["desirable"]) != len(arrays["ends"]):
                return None
        else:
            said_desirable = {}
        said = json.loads(notes.read_text()) if notes.exists() else {}
        said = {name: said[name] for name in NOTES if name in said}
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    ends = arrays["ends"]
    if not len(ends) or int(ends[-1]) != len(arrays["tokens"]) or len(arrays["targets"]) != len(arrays["tokens"]):
        return None
    return Tokenized(
        tokens=arrays["tokens"], targets=arrays["targets"], ends=np.asarray(ends), **said, **said_desirable
    )
