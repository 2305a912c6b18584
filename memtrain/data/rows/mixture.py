"""A recipe's list of datasets into training and validation rows: sequence length, weights, held-out tail, packing.

Per dataset: its cached samples (tokenized.py); text documents cut into seq_len pieces; other samples
longer than seq_len truncated or dropped (`data.truncation`); samples with no target token dropped.
Validation is `data.validation` (every sample once; weights do not apply) or, without it, the last
samples of each training dataset (a tail, as the text path holds out its last windows). Weights then
choose the training samples (mixing.py), and rows are packed or one sample each. Rows are put in a
seeded order so any prefix (the loop evaluates the first validation rows) mixes all datasets.
Every step is a function of the data, the recipe and the seed: a resumed run rebuilds the same rows.

`held_out_records` says which records the validation rows hold, from the same decision (`_prepare` and
`_split_tail`): the generation eval asks those questions and no other, so it never scores a sample that
training used, whatever was dropped on the way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from transformers import PreTrainedTokenizerBase

from memtrain.data.render.chat import template_where
from memtrain.data.render.templates import (
    conversation_template,
    ensure_template_tokens,
)
from memtrain.data.rows.overlap import CONVERSATION_TYPES, HeldOutOverlap, in_training, joined, keys_of
from memtrain.data.rows.packing import pack_rows
from memtrain.data.rows.pieces import cut_documents
from memtrain.data.rows.row_set import DataStats, SampleRows, SampleViews
from memtrain.data.rows.weights import held_out_tail, weighted_indices
from memtrain.data.tokens.tokenized import SampleRules, Tokenized, tokenized_dataset
from memtrain.errors import DataError, Problem
from memtrain.recipe.schema import Data, DatasetSpec

# Mixed into the seed for the row order, independent of the other seeded streams.
ROW_ORDER_STREAM = 0x726F77


@dataclass(frozen=True)
class _Part:
    """One dataset's usable samples, with what was left out on the way."""

    views: SampleViews
    truncated: np.ndarray  # bool per sample
    dropped_too_long: int
    dropped_no_targets: int
    records: np.ndarray  # int64 per sample: its record's position in the dataset's read order (text: document)

    def take(self, indices) -> _Part:
        indices = np.asarray(indices, dtype=np.int64)
        return _Part(
            self.views.take(indices),
            self.truncated[indices],
            self.dropped_too_long,
            self.dropped_no_targets,
            self.records[indices],
        )


@dataclass(frozen=True)
class HeldOutRecords:
    """Which records of one conversation dataset validation holds: those at `first` and after (by position in
    the dataset's read order, as `read_records` yields them). Of these, the records in `samples` are the
    validation samples; the others were left out by training (too long, no target) and are in neither split.
    """

    spec: DatasetSpec
    first: int  # 0 for a data.validation dataset; the first validation sample's record for a tail
    samples: np.ndarray  # int64, ascending: the records behind the dataset's validation samples
    # bool beside `samples`: the record's prompt (and its prompt and answer) training also holds (overlap.py);
    # None where that is not known (the training files are gone)
    prompt_in_train: np.ndarray | None = None
    pair_in_train: np.ndarray | None = None
    # int64: the records data.validation_dedup left out of validation (their prompt is in training): not asked, and
    # not counted as skipped either
    deduplicated: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


def build_rows(data: Data, tokenizer: PreTrainedTokenizerBase, seed: int) -> tuple[SampleRows, SampleRows]:
    """(train, validation) rows for a recipe whose data.train is a list of datasets (see the module doc).

    Adds the template's special tokens to `tokenizer` when data.add_special_tokens asks (call
    `ensure_template_tokens` first to learn which). Raises DataError for bad data, a dataset with no
    usable sample, or too few samples to hold a validation tail out.
    """
    if isinstance(data.train, str):
        raise ValueError("build_rows takes a list of datasets; a path is the text path (build_datasets)")
    ensure_template_tokens(data, tokenizer)
    rules = sample_rules(data, tokenizer)
    parts = [_prepare(spec, tokenizer, rules, data, "data.train") for spec in data.train]
    if data.validation is not None:
        held_out = [_prepare(spec, tokenizer, rules, data, "data.validation") for spec in data.validation]
    else:
        parts, held_out = zip(
            *(_split_tail(part, spec, data.validation_fraction, data.seq_len) for part, spec in zip(parts, data.train))
        )
    held_out, overlap = _against_training(list(held_out), list(parts), data)
    validation = _rows(held_out, data, tokenizer.pad_token_id, seed, overlap)
    chosen = [
        part.take(weighted_indices(len(part.views), spec.weight, seed, i))
        for i, (part, spec) in enumerate(zip(parts, data.train))
    ]
    for i, (part, spec, kept) in enumerate(zip(parts, data.train, chosen)):
        if len(part.views) and not len(kept.views):  # round(weight * n) is 0: the dataset would take no part
            raise DataError(
                Problem(
                    f"weight {spec.weight:g} of {len(part.views)} samples is "
                    f"round({spec.weight:g} × {len(part.views)}) "
                    "= 0 samples: this dataset would take no part in training",
                    key=f"data.train.{i}.weight",
                    file=spec.path,
                    hint=f"raise its weight to at least {0.5 / len(part.views):.2g} (a share of its own "
                    "samples: 1 uses each once), or leave the dataset out",
                )
            )
    return _rows(chosen, data, tokenizer.pad_token_id, seed, overlap), validation


def validation_rows(data: Data, tokenizer: PreTrainedTokenizerBase, seed: int) -> SampleRows:
    """build_rows' validation rows where data.validation names datasets of its own, built without reading
    data.train's (`memtrain eval` of a run whose training files are gone), unless data.validation_dedup needs them
    to leave out what training holds."""
    ensure_template_tokens(data, tokenizer)
    rules = sample_rules(data, tokenizer)
    held_out = [_prepare(spec, tokenizer, rules, data, "data.validation") for spec in data.validation]
    overlap = None
    if data.validation_dedup:
        trained = [_prepare(spec, tokenizer, rules, data, "data.train") for spec in data.train]
        held_out, overlap = _against_training(held_out, trained, data)
    return _rows(held_out, data, tokenizer.pad_token_id, seed, overlap)


def _against_training(
    held_out: list[_Part], trained: list[_Part], data: Data
) -> tuple[list[_Part], HeldOutOverlap | None]:
    """(held-out parts, what they share with training): each held-out conversation sample whose prompt (and whose
    prompt and answer) the training side's records also hold, counted (overlap.py); with data.validation_dedup
    those samples are left out of validation. The training side is every record training draws from, before
    weights. None when validation holds no conversation dataset."""
    specs = data.validation if data.validation is not None else data.train
    if not any(spec.type in CONVERSATION_TYPES for spec in specs):
        return held_out, None
    training = joined([keys_of(spec, data.cache_dir, part.records) for spec, part in zip(data.train, trained)])
    kept, samples, prompts, answers, dropped = [], 0, 0, 0, 0
    for spec, part in zip(specs, held_out):
        if spec.type in CONVERSATION_TYPES:
            seen_prompt, seen_pair = in_training(keys_of(spec, data.cache_dir, part.records), training)
            samples += len(seen_prompt)
            prompts += int(seen_prompt.sum())
            answers += int(seen_pair.sum())
            if data.validation_dedup and seen_prompt.any():
                dropped += int(seen_prompt.sum())
                part = part.take(np.flatnonzero(~seen_prompt))
        kept.append(part)
    if dropped and not sum(len(part.views) for part in kept):
        raise DataError(
            Problem(
                f"every one of the {samples} held-out samples has a prompt that training also holds: "
                "data.validation_dedup leaves nothing to validate on",
                key="data.validation_dedup",
                hint="hold out records that training does not hold (data.validation), or set "
                "data.validation_dedup: false to validate on them anyway",
            )
        )
    return kept, HeldOutOverlap(samples, prompts, answers, dropped)


def noted_datasets(data: Data, tokenizer: PreTrainedTokenizerBase) -> list[tuple[DatasetSpec, Tokenized]]:
    """(spec, its token-cache entry) of each listed conversation dataset (completion, instruction, chat), train's then
    validation's; none when the data is one text path. The entries' notes (counts and first lines) are what the data
    warnings below say: read once, handed to each of them. Reads the token cache
    that building the rows filled (`tokenizer` as for `held_out_records`)."""
    if isinstance(data.train, str):
        return []
    rules = sample_rules(data, tokenizer)
    return [
        (spec, tokenized_dataset(spec, tokenizer, rules, data.cache_dir))
        for spec in [*data.train, *(data.validation or [])]
        if spec.type != "text"
    ]


def unwritten_messages_warning(
    data: Data, tokenizer: PreTrainedTokenizerBase, noted: list[tuple[DatasetSpec, Tokenized]] | None = None
) -> str | None:
    """A warning for people when the chat template left some messages of the conversations out of what it wrote
    (Mistral's writes a system message only before the last user turn, so never in a conversation that ends with
    an answer): the model trains without them, and is prompted with them. None when it wrote every message.
    noted: `noted_datasets` (read here when not given)."""
    noted = noted_datasets(data, tokenizer) if noted is None else noted
    said = [
        f"the {role} message of {_first_at(count, 'conversation', spec.path, line)}"
        for spec, tokenized in noted
        for role, (count, line) in sorted(tokenized.unwritten.items())
    ]
    if not said:
        return None
    template = template_where(sample_rules(data, tokenizer).template)
    return (
        f"{template} did not write {'; '.join(said)}: the model trains without those messages, though a "
        "prompt may hold them (a template that writes the system message only before the last user turn, as "
        "Mistral's does) — put that text into the first user message, or set a template that writes every "
        "message (data.template: chatml, with data.add_special_tokens)"
    )


def trailing_turns_warning(
    data: Data, tokenizer: PreTrainedTokenizerBase, noted: list[tuple[DatasetSpec, Tokenized]] | None = None
) -> str | None:
    """A warning for people when conversations go on past their last answer (a user or system message after the
    last assistant message, as scraped chat logs often end): those messages are tokens no trained answer follows,
    kept as they are (with data.train_on_inputs they are targets like every token). None when every conversation
    ends with an answer (completion and instruction records always do). noted: `noted_datasets` (read here when
    not given)."""
    noted = noted_datasets(data, tokenizer) if noted is None else noted
    trailing = [
        (tokenized.trailing[0], spec.path, tokenized.trailing[1]) for spec, tokenized in noted if tokenized.trailing
    ]
    if not trailing:
        return None
    said = [_first_at(count, "conversation", path, line) for count, path, line in trailing]
    verb = "ends" if sum(count for count, _, _ in trailing) == 1 else "end"
    trained = (
        "are trained on as targets (data.train_on_inputs)"
        if data.train_on_inputs
        else "are tokens no trained answer follows: they take sequence length and compute and teach nothing"
    )
    return (
        f"{'; '.join(said)} {verb} with a user or system message after the last assistant message: those messages "
        f"{trained} — end each conversation with its answer (drop what follows it), or leave it if that is meant"
    )


def untrainable_records_warning(
    data: Data, tokenizer: PreTrainedTokenizerBase, noted: list[tuple[DatasetSpec, Tokenized]] | None = None
) -> str | None:
    """A warning for people when data.skip_untrainable left records out (no assistant message, an empty answer):
    which dataset, how many, the first one's line. None when it left none out. noted: `noted_datasets` (read here
    when not given)."""
    if not data.skip_untrainable:
        return None
    noted = noted_datasets(data, tokenizer) if noted is None else noted
    said = [
        _first_at(tokenized.skipped[0], "record", spec.path, tokenized.skipped[1])
        for spec, tokenized in noted
        if tokenized.skipped
    ]
    if not said:
        return None
    return (
        f"data.skip_untrainable: left out {'; '.join(said)} with nothing to train on (no assistant message, or an "
        "empty or null answer) — fix those records to train on them, or leave them out of the files"
    )


def unread_system_warning(
    data: Data, tokenizer: PreTrainedTokenizerBase, noted: list[tuple[DatasetSpec, Tokenized]] | None = None
) -> str | None:
    """A warning for people when records hold a system prompt in a field their dataset does not read
    (conversation.unread_system_field): the model trains without it, and nothing else says so. None when
    no record does. noted: `noted_datasets` (read here when not given)."""
    noted = noted_datasets(data, tokenizer) if noted is None else noted
    said = [
        f"the {name!r} field of {_first_at(count, 'record', spec.path, line)} (system_field: {name} reads it)"
        for spec, tokenized in noted
        for name, (count, line) in sorted(tokenized.unread_system.items())
    ]
    if not said:
        return None
    return (
        f"a system prompt is not read from {'; '.join(said)}: the model trains without it — set the dataset's "
        "system_field to train with it as the system message, or leave it out of the files"
    )


def _first_at(count: int, noun: str, path: str, line: int) -> str:
    return f"{count} {noun}{'s' if count != 1 else ''} of {path} (the first at line {line})"


def held_out_records(data: Data, tokenizer: PreTrainedTokenizerBase) -> list[HeldOutRecords]:
    """For each conversation dataset that validation draws from (data.validation's, else data.train's), the
    records its validation samples come from, as `build_rows` splits them: a training sample is never among
    them, whether samples were dropped before the split or not. Text datasets are left out (a piece of a
    document is no question to ask).

    `tokenizer` must be the one the rows were built with (template tokens added); the samples come from the
    token cache that building the rows filled. Raises DataError as `build_rows` does.
    """
    if isinstance(data.train, str):
        return []
    rules = sample_rules(data, tokenizer)
    if data.validation is not None:
        specs = list(data.validation)
        held_out = [_prepare(spec, tokenizer, rules, data, "data.validation") for spec in specs]
        firsts = [0] * len(specs)
        try:
            trained = [_prepare(spec, tokenizer, rules, data, "data.train") for spec in data.train]
        except DataError:
            if data.validation_dedup:
                raise
            trained = None  # training files that are gone (`memtrain eval` later): what they share is not known
    else:
        specs = list(data.train)
        trained, held_out = (
            list(split)
            for split in zip(
                *(
                    _split_tail(
                        _prepare(spec, tokenizer, rules, data, "data.train"),
                        spec,
                        data.validation_fraction,
                        data.seq_len,
                    )
                    for spec in specs
                )
            )
        )
        firsts = [int(part.records[0]) for part in held_out]
    before = held_out
    if trained is not None:
        held_out, _ = _against_training(held_out, trained, data)
        training = joined([keys_of(spec, data.cache_dir, part.records) for spec, part in zip(data.train, trained)])
    return [
        HeldOutRecords(
            spec,
            first,
            part.records,
            *(in_training(keys_of(spec, data.cache_dir, part.records), training) if trained is not None else ()),
            deduplicated=np.setdiff1d(everything.records, part.records),
        )
        for spec, first, part, everything in zip(specs, firsts, held_out, before)
        if spec.type != "text"
    ]


def sample_rules(data: Data, tokenizer: PreTrainedTokenizerBase) -> SampleRules:
    """How the recipe's records become samples: the same for the rows and for `held_out_records`, so both read
    the same cached samples (and for preference and kto pairs, pairs.py). Pairs without data.template are written
    with the tokenizer's own template where it has one, and need none when they are text (pair_template)."""
    return SampleRules(
        template=conversation_template(data, tokenizer),
        train_on_inputs=data.train_on_inputs,
        train_on=data.train_on,
        skip_untrainable=data.skip_untrainable,
    )


def _prepare(spec: DatasetSpec, tokenizer, rules: SampleRules, data: Data, key: str) -> _Part:
    """The dataset's samples fitted to seq_len, those with no target left out."""
    tokenized = tokenized_dataset(spec, tokenizer, rules, data.cache_dir)
    starts, lengths = tokenized.starts, np.diff(tokenized.ends, prepend=0)
    records = np.arange(len(starts), dtype=np.int64)  # a conversation dataset has one sample per record
    seq_len = data.seq_len
    dropped_too_long = 0
    if spec.type == "text":  # documents are cut into seq_len pieces, as the text path cuts its stream
        owners, starts, lengths = cut_documents(starts, lengths, seq_len)
        records = records[owners]
        truncated = np.zeros(len(starts), dtype=bool)
    else:
        too_long = lengths > seq_len
        if data.truncation == "drop":
            dropped_too_long = int(too_long.sum())
            starts, lengths, truncated = starts[~too_long], lengths[~too_long], np.zeros(int((~too_long).sum()), bool)
            records = records[~too_long]
        else:
            truncated, lengths = too_long, np.minimum(lengths, seq_len)
    views = SampleViews(
        (tokenized.tokens,),
        (tokenized.targets,),
        np.zeros(len(starts), dtype=np.int64),
        starts.astype(np.int64),
        lengths.astype(np.int64),
    )
    useful = views.target_counts() > 0
    skipped = tokenized.skipped[0] if tokenized.skipped else 0  # data.skip_untrainable's empty samples: said apart
    part = _Part(views, truncated, dropped_too_long, int((~useful).sum()) - skipped, records).take(
        np.flatnonzero(useful)
    )
    if len(part.views) == 0:
        if data.truncation == "drop":
            said = (
                f"{dropped_too_long} longer than {seq_len} tokens (truncation: drop), {part.dropped_no_targets} "
                f"without a target token within {seq_len} tokens"
            )
            hint = "raise data.seq_len, set data.truncation: truncate, or check that the records have responses"
        else:
            said = (
                f"{part.dropped_no_targets} without a target token within their first {seq_len} tokens "
                "(truncation: truncate keeps a sample's start, and the answers come after the prompts)"
            )
            hint = "raise data.seq_len, or check that the records have responses"
        raise DataError(
            Problem(f"no sample of the dataset is left to train on: {said}", key=key, file=spec.path, hint=hint)
        )
    return part


def document_samples(data: Data, train_set: SampleRows) -> np.ndarray:
    """Which of `build_rows`' training samples (train_set.samples, bool each) are pieces of a text dataset's
    documents rather than whole samples: each dataset of data.train is one source of the samples, in its order."""
    text = np.asarray([spec.type == "text" for spec in data.train], dtype=bool)
    return text[train_set.samples.source]


def _split_tail(part: _Part, spec: DatasetSpec, fraction: float, seq_len: int) -> tuple[_Part, _Part]:
    """(training, validation) samples of a dataset without data.validation: the last `fraction` of its usable
    samples (after the drops) are held out; `held_out_records` reads the same split, so keep one decision here."""
    n = len(part.views)
    n_validation = held_out_tail(n, fraction)
    if n - n_validation < 1:
        raise DataError(
            Problem(
                f"the dataset gives {n} sample(s) of at most {seq_len} tokens, too few to hold {n_validation} out for "
                "validation and train on the rest",
                key="data.train",
                file=spec.path,
                hint="set data.validation to separate datasets, or add data",
            )
        )
    head = part.take(np.arange(n - n_validation))
    tail = part.take(np.arange(n - n_validation, n))
    # What was left out belongs to the training side's report only.
    return head, _Part(tail.views, tail.truncated, 0, 0, tail.records)


def _rows(parts: list[_Part], data: Data, pad_id: int, seed: int, overlap: HeldOutOverlap | None = None) -> SampleRows:
    views = SampleViews.concat([p.views for p in parts])
    if data.packing:
        rows = pack_rows(views.length, data.seq_len)
    else:
        rows = [[i] for i in range(len(views))]
    order = np.random.default_rng([seed, ROW_ORDER_STREAM]).permutation(len(rows))
    rows = [rows[i] for i in order]
    dataset = SampleRows(views, rows, data.seq_len, pad_id)
    stats = DataStats(
        samples=len(views),
        truncated=int(sum(p.truncated.sum() for p in parts)),
        dropped_too_long=sum(p.dropped_too_long for p in parts),
        dropped_no_targets=sum(p.dropped_no_targets for p in parts),
        rows=len(dataset),
        tokens=dataset.n_tokens,
        target_tokens=dataset.targets(np.arange(len(dataset))),
        seq_len=data.seq_len,
        held_out=overlap,
    )
    dataset.stats = stats
    return dataset
