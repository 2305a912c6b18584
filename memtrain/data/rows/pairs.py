"""Preference pairs and KTO records as training sets: what a preference objective's micro-batches are made of.

A pair is two sequences, its prompt with the chosen answer and with the rejected one, each a view into a dataset's
cached samples (tokens/tokenized.py: record i's chosen at sample 2i, its rejected at 2i + 1). A KTO record is one
sequence, its prompt with its answer, and a KL sequence: its prompt with the answer of another record of its dataset
(a seeded derangement made once, so the KL rows and their reference log-probabilities do not depend on the
micro-batch), the mismatched completion whose log-ratio is KTO's reference point.

Fitting seq_len: a sequence longer than seq_len loses the start of its prompt (the prompt keeps its end, the
part next to the answer) and then the end of its answer. The prompt gives way first, down to half of seq_len, so
a long answer cannot push the whole question out; both answers of a pair are cut against the longer one, so the two
keep the same prompt. With data.truncation drop such a pair (record) is left out instead. A sequence left with no
target token, and a pair whose two answers are the same tokens (nothing to prefer), are left out and counted.
Weights, the held-out tail without data.validation, and the seeded order are those of SFT's rows (mixture.py), a
pair (record) being one sample: a resumed run rebuilds the same sets.

Batches (`collate`): B pairs give 2B rows, rows 0..B-1 the chosen sequences and B..2B-1 the rejected ones; KTO's
B records give the records then their KL rows, with `kto_label` (desirable) per record. Rows are right-padded to
seq_len, or to the longest row rounded up to 8 with `trim`; `labels` holds the token at a target position and -100
elsewhere (prompt, padding, each row's first token), unshifted as SampleRows' are; `attention_mask` is 1 on real
tokens. A set with reference log-probabilities attached (`with_reference`) adds `ref_logps` (float32 per row).
Pairs laid out packed (`pack`, where varlen attention keeps sequences apart: model/attention.py) are written end
to end in rows of twice seq_len instead, with `position_ids` restarting at every sequence and `sequence_ids` saying
whose each position is, in the same order as the rows above (PairRows._collate_packed); no attention mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from memtrain.data.render.templates import ensure_template_tokens
from memtrain.data.rows.loader import batch_width, next_fit_rows
from memtrain.data.rows.mixture import HeldOutRecords, sample_rules
from memtrain.data.rows.row_set import DataStats, SampleViews
from memtrain.data.rows.weights import held_out_tail, weighted_indices
from memtrain.data.tokens.tokenized import SampleRules, Tokenized, tokenized_dataset
from memtrain.errors import DataError, Problem
from memtrain.labels import IGNORE_INDEX
from memtrain.recipe.schema import Data, DatasetSpec

# Mixed into the seed: the order of the pairs (as mixture.ROW_ORDER_STREAM orders SFT rows) and KTO's KL partners.
PAIR_ORDER_STREAM = 0x726F77
KL_STREAM = 0x6B6C


@dataclass(frozen=True)
class PairStats(DataStats):
    """DataStats of a pair set: `samples` counts pairs (KTO: records), `rows` their sequences (two each),
    `truncated` the pairs cut to seq_len, `dropped_too_long` those left out for it (truncation: drop),
    `dropped_no_targets` those with a sequence left without a target token."""

    identical: int = 0  # preference pairs whose two answers were the same tokens, left out
    kind: str = "pairs"  # "pairs" | "kto records"

    def describe(self) -> str:
        return (
            f"{self.samples} {self.kind} ({self.rows} sequences of at most {self.seq_len} tokens): {self.tokens} "
            f"tokens, {self.target_tokens} targets, {self.padding_share:.1%} padding; {self.truncated} cut to "
            f"seq_len (the prompt's start, then the answer's end), {self.dropped_too_long} too long and "
            f"{self.dropped_no_targets} without targets left out"
            + (f", {self.identical} with identical answers left out" if self.kind == "pairs" else "")
        )


class _Rows:
    """What both sets share: views per role (each len(self) long), reference log-probs, the batch's tensors."""

    sequences_per_item = 2  # rows of a batch per pair or record: the planner and the loader's token count read it
    roles: tuple[str, ...] = ()

    def __init__(self, views: dict[str, SampleViews], seq_len: int, pad_id: int, stats: PairStats | None = None):
        self.views = views
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.stats = stats
        self.reference: np.ndarray | None = None  # float32 [len, 2]: the rows' reference log-probs, when attached

    def __len__(self) -> int:
        return len(next(iter(self.views.values())))

    @property
    def lengths(self) -> np.ndarray:
        """Real tokens of each item's longest row: what bucketing sorts by and `trim` cuts to."""
        return np.maximum(*self._row_lengths())

    @property
    def n_tokens(self) -> int:
        """Real tokens over every row of every item."""
        return int(sum(lengths.sum() for lengths in self._row_lengths()))

    def targets(self, indices) -> int:
        """What the loss is normalised by: one per pair (record), so len(indices)."""
        return len(np.asarray(indices).reshape(-1))

    def target_tokens(self, indices=None) -> int:
        """Target tokens over every row of the items at `indices` (all: None), for the stats and the planner's
        data per step (the loss is normalised by `targets`, the pairs)."""
        picked = slice(None) if indices is None else np.asarray(indices, dtype=np.int64)
        return int(sum(self.views[role].target_counts()[picked].sum() for role in self.roles))

    def tokens_of(self, indices) -> int:
        """Real tokens over every row of the items at `indices` (`lengths` is each item's longest row only)."""
        indices = np.asarray(indices, dtype=np.int64)
        return int(sum(lengths[indices].sum() for lengths in self._row_lengths()))

    def select(self, indices):
        """The items at `indices` (in that order), their reference log-probs with them; stats are not carried over."""
        indices = np.asarray(indices, dtype=np.int64)
        chosen = type(self)({k: v.take(indices) for k, v in self.views.items()}, self.seq_len, self.pad_id)
        chosen.reference = None if self.reference is None else self.reference[indices]
        return chosen

    def with_reference(self, logps: np.ndarray):
        """This set with the reference model's log-probs of each item's two rows ([len, 2]: chosen, rejected; KTO:
        the record, its KL row) attached: its batches carry them as `ref_logps`."""
        logps = np.asarray(logps, dtype=np.float32)
        if logps.shape != (len(self), 2):
            raise ValueError(f"reference log-probs must be [{len(self)}, 2], got {list(logps.shape)}")
        attached = self.select(np.arange(len(self)))
        attached.stats = self.stats
        attached.reference = logps
        return attached

    def collate(self, indices: list[int], trim: bool = False, pack: bool = False) -> dict[str, torch.Tensor]:
        """The micro-batch of the items at `indices` (module doc); `pack`: laid end to end (PairRows only)."""
        if pack:
            return self._collate_packed(indices)
        indices = np.asarray(indices, dtype=np.int64)
        rows = self._rows(indices)
        width = batch_width(np.asarray([sum(int(v.length[i]) for v, i in row) for row in rows]), self.seq_len)
        width = width if trim else self.seq_len
        input_ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        labels = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for r, row in enumerate(rows):
            at = 0
            for views, i in row:
                source, start, length = int(views.source[i]), int(views.start[i]), int(views.length[i])
                ids = views.tokens[source][start : start + length].astype(np.int64)  # uint16 would wrap -100
                input_ids[r, at : at + length] = ids
                labels[r, at : at + length] = np.where(views.targets[source][start : start + length] != 0, ids, -100)
                at += length
            labels[r, 0] = IGNORE_INDEX  # nothing in the row predicts its first token
            mask[r, :at] = 1
        batch = {
            "input_ids": torch.from_numpy(input_ids),
            "labels": torch.from_numpy(labels),
            "attention_mask": torch.from_numpy(mask),
        }
        return self._with_reference_logps(batch, indices)

    def _with_reference_logps(self, batch: dict[str, torch.Tensor], indices: np.ndarray) -> dict[str, torch.Tensor]:
        """The batch with `ref_logps` (the items' first rows, then their second) when reference log-probs are
        attached: the order of the batch's sequences."""
        if self.reference is not None:
            batch["ref_logps"] = torch.from_numpy(
                np.concatenate([self.reference[indices, 0], self.reference[indices, 1]])
            )
        return batch

    def _collate_packed(self, indices: list[int]) -> dict[str, torch.Tensor]:
        raise ValueError(f"{type(self).__name__} batches are not laid out packed")

    def _rows(self, indices: np.ndarray) -> list[list[tuple[SampleViews, int]]]:
        raise NotImplementedError

    def _row_lengths(self) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError


class PairRows(_Rows):
    """Preference pairs: item i is pair i, views "chosen" and "rejected" (module doc)."""

    roles = ("chosen", "rejected")

    def _rows(self, indices):
        return [[(self.views["chosen"], i)] for i in indices] + [[(self.views["rejected"], i)] for i in indices]

    def _row_lengths(self):
        return self.views["chosen"].length, self.views["rejected"].length

    def packing_units(self) -> tuple[np.ndarray, int]:
        """(each pair's two sequences together, the width pairs are laid out in): twice seq_len, the positions of
        the two rows a pair takes unpacked, so a pair always fits one (data/rows/loader.py lays steps out)."""
        chosen, rejected = self._row_lengths()
        return chosen + rejected, 2 * self.seq_len

    def _collate_packed(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """The pairs at `indices`, in the order loader.packed_micro_batches wrote them, laid end to end in rows of
        twice seq_len (`next_fit_rows` finds each row's pairs): a pair's chosen sequence, then its rejected one,
        each starting at position 0, so varlen attention keeps every sequence to itself; padding ends a row.
        `sequence_ids` names each position's sequence as the unpacked batch orders its rows: the chosen sequence of
        the k-th pair is k, its rejected one B + k, padding -1. Each sequence's first label is -100: nothing
        before it in the row belongs to it."""
        indices = np.asarray(indices, dtype=np.int64)
        lengths, width = self.packing_units()
        groups = next_fit_rows(lengths[indices], width)
        shape = (len(groups), width)
        input_ids = np.full(shape, self.pad_id, dtype=np.int64)
        labels = np.full(shape, IGNORE_INDEX, dtype=np.int64)
        positions = np.zeros(shape, dtype=np.int64)
        sequence_ids = np.full(shape, -1, dtype=np.int64)
        for r, group in enumerate(groups):
            at = 0
            for member in group:
                for side, role in enumerate(self.roles):
                    views, i = self.views[role], indices[member]
                    source, start, length = int(views.source[i]), int(views.start[i]), int(views.length[i])
                    ids = views.tokens[source][start : start + length].astype(np.int64)
                    targets = views.targets[source][start : start + length] != 0
                    input_ids[r, at : at + length] = ids
                    labels[r, at : at + length] = np.where(targets, ids, IGNORE_INDEX)
                    labels[r, at] = IGNORE_INDEX
                    positions[r, at : at + length] = np.arange(length)
                    sequence_ids[r, at : at + length] = member + side * len(indices)
                    at += length
            # padding goes on from the last sequence's positions: varlen counts it into that sequence, whose real
            # tokens never attend to it under the causal mask, and its labels are -100
            positions[r, at:] = np.arange(positions[r, at - 1] + 1, positions[r, at - 1] + 1 + width - at)
        batch = {
            "input_ids": torch.from_numpy(input_ids),
            "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(positions),
            "sequence_ids": torch.from_numpy(sequence_ids),
        }
        return self._with_reference_logps(batch, indices)


class KtoRows(_Rows):
    """KTO records: item i is record i, views "record" (its sequence), "prompt" and "kl_answer" (its KL row: its
    prompt, then another record's answer) and `desirable` per record (module doc)."""

    roles = ("record", "kl_answer")

    def __init__(self, views, seq_len, pad_id, stats=None, desirable: np.ndarray | None = None):
        super().__init__(views, seq_len, pad_id, stats)
        self.desirable = np.zeros(len(self), dtype=bool) if desirable is None else np.asarray(desirable, dtype=bool)

    def select(self, indices):
        chosen = super().select(indices)
        chosen.desirable = self.desirable[np.asarray(indices, dtype=np.int64)]
        return chosen

    def collate(self, indices: list[int], trim: bool = False, pack: bool = False) -> dict[str, torch.Tensor]:
        batch = super().collate(indices, trim, pack)
        batch["kto_label"] = torch.from_numpy(self.desirable[np.asarray(indices, dtype=np.int64)].copy())
        return batch

    def _rows(self, indices):
        v = self.views
        return [[(v["record"], i)] for i in indices] + [[(v["prompt"], i), (v["kl_answer"], i)] for i in indices]

    def _row_lengths(self):
        return self.views["record"].length, self.views["prompt"].length + self.views["kl_answer"].length


# ---------------------------------------------------------------- building the sets


@dataclass(frozen=True)
class _Part:
    """One dataset's usable pairs (records), with what was left out on the way."""

    views: dict[str, SampleViews]
    cut: np.ndarray  # bool per item
    desirable: np.ndarray  # bool per item (kto), empty for pairs
    records: np.ndarray  # int64 per item: its record's position in the dataset's read order
    dropped_too_long: int = 0
    dropped_no_targets: int = 0
    identical: int = 0
    identical_line: int | None = None  # the first such record's line (the token cache's note)
    extra: dict = field(default_factory=dict)

    def take(self, indices) -> _Part:
        indices = np.asarray(indices, dtype=np.int64)
        return replace(
            self,
            views={k: v.take(indices) for k, v in self.views.items()},
            cut=self.cut[indices],
            records=self.records[indices],
            desirable=self.desirable[indices] if len(self.desirable) else self.desirable,
        )


def build_pair_sets(data: Data, tokenizer: PreTrainedTokenizerBase, seed: int):
    """(train, validation) sets of a recipe whose datasets are preference or kto records (PairRows or KtoRows).
    Raises DataError for bad records, a dataset with no usable pair, or too few to hold a validation tail out."""
    ensure_template_tokens(data, tokenizer)
    rules = sample_rules(data, tokenizer)
    parts = [_prepare(spec, tokenizer, rules, data, f"data.train.{i}", seed, i) for i, spec in enumerate(data.train)]
    if data.validation is not None:
        validation = pair_validation_set(data, tokenizer, seed)
    else:
        parts, held_out = zip(*(_split_tail(part, spec, data) for part, spec in zip(parts, data.train)))
        validation = _set(list(held_out), data, tokenizer.pad_token_id, seed)
    chosen = []
    for i, (part, spec) in enumerate(zip(parts, data.train)):
        kept = part.take(weighted_indices(len(part.cut), spec.weight, seed, i))
        if len(part.cut) and not len(kept.cut):
            raise DataError(
                Problem(
                    f"weight {spec.weight:g} of {len(part.cut)} pairs is round({spec.weight:g} × {len(part.cut)}) = 0: "
                    "this dataset would take no part in training",
                    key=f"data.train.{i}.weight",
                    file=spec.path,
                    hint=f"raise its weight to at least {0.5 / len(part.cut):.2g}, or leave the dataset out",
                )
            )
        chosen.append(kept)
    return _set(chosen, data, tokenizer.pad_token_id, seed), validation


def held_out_pair_records(data: Data, tokenizer: PreTrainedTokenizerBase) -> list[HeldOutRecords]:
    """For each dataset validation draws from (data.validation's, else data.train's), the records its validation
    pairs (KTO records) come from, as `build_pair_sets` splits them (mixture.held_out_records for pairs): a training
    pair is never among them. `tokenizer` as the sets were built with; reads the token cache they filled."""
    rules = sample_rules(data, tokenizer)
    if data.validation is not None:
        return [
            HeldOutRecords(spec, 0, _prepare(spec, tokenizer, rules, data, f"data.validation.{i}", 0, i).records)
            for i, spec in enumerate(data.validation)
        ]
    held_out = []
    for i, spec in enumerate(data.train):
        _, tail = _split_tail(_prepare(spec, tokenizer, rules, data, f"data.train.{i}", 0, i), spec, data)
        held_out.append(HeldOutRecords(spec, int(tail.records.min()), np.sort(tail.records)))
    return held_out


def pair_validation_set(data: Data, tokenizer: PreTrainedTokenizerBase, seed: int):
    """build_pair_sets' validation set where data.validation names datasets of its own (data.train is not read)."""
    ensure_template_tokens(data, tokenizer)
    rules = sample_rules(data, tokenizer)
    held_out = [
        _prepare(spec, tokenizer, rules, data, f"data.validation.{i}", seed, i)
        for i, spec in enumerate(data.validation)
    ]
    return _set(held_out, data, tokenizer.pad_token_id, seed)


def prompt_lengths(views: SampleViews) -> np.ndarray:
    """Tokens before each sample's first target token (its prompt); the sample's length when it has none."""
    out = np.empty(len(views), dtype=np.int64)
    for i in range(len(views)):
        source, start, length = int(views.source[i]), int(views.start[i]), int(views.length[i])
        flags = np.asarray(views.targets[source][start : start + length])
        hits = np.flatnonzero(flags)
        out[i] = hits[0] if len(hits) else length
    return out


def fit(prompts: list[np.ndarray], answers: list[np.ndarray], seq_len: int) -> tuple[list, list]:
    """(prompt tokens kept, answer tokens kept) of each sequence of an item so that each holds at most seq_len tokens:
    every prompt keeps its end, down to half of seq_len where the item's longest answer needs the room, then each
    answer keeps its start (module doc). Each array holds one length per item."""
    room = np.maximum(seq_len - np.maximum.reduce(answers), seq_len // 2)
    kept = [np.minimum(prompt, room) for prompt in prompts]
    return kept, [np.minimum(answer, seq_len - k) for answer, k in zip(answers, kept)]


def _prepare(spec: DatasetSpec, tokenizer, rules: SampleRules, data: Data, key: str, seed: int, index: int) -> _Part:
    tokenized = tokenized_dataset(spec, tokenizer, rules, data.cache_dir)
    part = _pairs(tokenized, data) if spec.type == "preference" else _kto(tokenized, data, seed, index)
    if not len(part.cut):
        raise DataError(
            Problem(
                f"no {'pair' if spec.type == 'preference' else 'record'} of the dataset is left to train on: "
                f"{part.dropped_too_long} longer than {data.seq_len} tokens (truncation: drop), "
                f"{part.dropped_no_targets} without an answer token within {data.seq_len} tokens, {part.identical} "
                "with identical answers",
                key=key,
                file=spec.path,
                hint="raise data.seq_len, set data.truncation: truncate, or check the records' answers",
            )
        )
    return part


def _sequences(tokenized: Tokenized, which: np.ndarray) -> SampleViews:
    starts = np.concatenate([np.zeros(1, dtype=np.int64), tokenized.ends[:-1]])
    lengths = np.diff(tokenized.ends, prepend=0)
    return SampleViews(
        (tokenized.tokens,),
        (tokenized.targets,),
        np.zeros(len(which), dtype=np.int64),
        starts[which].astype(np.int64),
        lengths[which].astype(np.int64),
    )


def _cut(views: SampleViews, prompt: np.ndarray, kept_prompt: np.ndarray, kept_answer: np.ndarray) -> SampleViews:
    """The views with the prompt's first (prompt - kept_prompt) tokens and the answer's end beyond kept_answer cut."""
    return SampleViews(
        views.tokens, views.targets, views.source, views.start + prompt - kept_prompt, kept_prompt + kept_answer
    )


def _pairs(tokenized: Tokenized, data: Data) -> _Part:
    n = len(tokenized.ends) // 2
    chosen, rejected = _sequences(tokenized, np.arange(n) * 2), _sequences(tokenized, np.arange(n) * 2 + 1)
    too_long = np.maximum(chosen.length, rejected.length) > data.seq_len
    # prompt lengths matter only where a pair is cut (a Python loop over the pairs: only those)
    pc, pr = chosen.length.copy(), rejected.length.copy()
    long_pairs = np.flatnonzero(too_long)
    pc[long_pairs] = prompt_lengths(chosen.take(long_pairs))
    pr[long_pairs] = prompt_lengths(rejected.take(long_pairs))
    # both answers are cut against the longer one, so the two keep the same prompt
    (kept_c, kept_r), (ans_c, ans_r) = fit([pc, pr], [chosen.length - pc, rejected.length - pr], data.seq_len)
    chosen, rejected = _cut(chosen, pc, kept_c, ans_c), _cut(rejected, pr, kept_r, ans_r)
    same = np.zeros(n, dtype=bool)
    for i in np.flatnonzero(chosen.length == rejected.length):  # only pairs of equal length can be the same
        c, r = chosen.start[i], rejected.start[i]
        same[i] = np.array_equal(
            tokenized.tokens[c : c + chosen.length[i]], tokenized.tokens[r : r + rejected.length[i]]
        )
    useful = (chosen.target_counts() > 0) & (rejected.target_counts() > 0)
    keep = useful & ~same
    dropped = 0
    if data.truncation == "drop":
        dropped = int((too_long & keep).sum())
        keep &= ~too_long
    part = _Part(
        {"chosen": chosen, "rejected": rejected},
        too_long,
        np.zeros(0, dtype=bool),
        np.arange(n, dtype=np.int64),
        dropped_too_long=dropped,
        dropped_no_targets=int((~useful & ~same).sum()),
        identical=int(same.sum()),
        identical_line=tokenized.identical[1] if tokenized.identical else None,
    )
    return part.take(np.flatnonzero(keep))


def _kto(tokenized: Tokenized, data: Data, seed: int, index: int) -> _Part:
    n = len(tokenized.ends)
    record = _sequences(tokenized, np.arange(n))
    too_long = record.length > data.seq_len
    prompt = prompt_lengths(record)
    answer = record.length - prompt
    (kept_p,), (kept_a,) = fit([prompt], [answer], data.seq_len)
    record = _cut(record, prompt, kept_p, kept_a)
    useful = record.target_counts() > 0
    keep = useful.copy()
    dropped = 0
    if data.truncation == "drop":
        dropped = int((too_long & keep).sum())
        keep &= ~too_long
    desirable = np.asarray(tokenized.desirable, dtype=bool)
    rows = np.flatnonzero(keep)
    record = record.take(rows)
    kept_p = kept_p[rows]
    # the KL partner: another record of the dataset, a seeded derangement (itself only when it is alone)
    order = np.random.default_rng([seed, index, KL_STREAM]).permutation(len(rows))
    partner = np.empty(len(rows), dtype=np.int64)
    partner[order] = np.roll(order, 1)
    prompt_views = SampleViews(record.tokens, record.targets, record.source, record.start, kept_p)
    partner_answer = record.length[partner] - kept_p[partner]
    kl_answer = SampleViews(
        record.tokens,
        record.targets,
        record.source[partner],
        record.start[partner] + kept_p[partner],
        np.minimum(partner_answer, data.seq_len - kept_p),
    )
    return _Part(
        {"record": record, "prompt": prompt_views, "kl_answer": kl_answer},
        too_long[rows],
        desirable[rows],
        rows.astype(np.int64),
        dropped_too_long=dropped,
        dropped_no_targets=int((~useful).sum()),
    )


def _split_tail(part: _Part, spec: DatasetSpec, data: Data) -> tuple[_Part, _Part]:
    """(training, validation) pairs of a dataset without data.validation: the last validation_fraction of its usable
    pairs, as mixture._split_tail holds out samples."""
    n = len(part.cut)
    n_validation = held_out_tail(n, data.validation_fraction)
    if n - n_validation < 1:
        raise DataError(
            Problem(
                f"the dataset gives {n} usable pair(s), too few to hold {n_validation} out for validation and train on "
                "the rest",
                key="data.train",
                file=spec.path,
                hint="set data.validation to separate datasets, or add data",
            )
        )
    head, tail = part.take(np.arange(n - n_validation)), part.take(np.arange(n - n_validation, n))
    # what was left out belongs to the training side's report only
    return head, replace(tail, dropped_too_long=0, dropped_no_targets=0, identical=0, identical_line=None)


def _set(parts: list[_Part], data: Data, pad_id: int, seed: int):
    views = {role: SampleViews.concat([p.views[role] for p in parts]) for role in parts[0].views}
    order = np.random.default_rng([seed, PAIR_ORDER_STREAM]).permutation(len(next(iter(views.values()))))
    views = {role: v.take(order) for role, v in views.items()}
    kto = "record" in views
    if kto:
        out = KtoRows(views, data.seq_len, pad_id, desirable=np.concatenate([p.desirable for p in parts])[order])
    else:
        out = PairRows(views, data.seq_len, pad_id)
    out.stats = PairStats(
        samples=len(out),
        truncated=int(sum(p.cut.sum() for p in parts)),
        dropped_too_long=sum(p.dropped_too_long for p in parts),
        dropped_no_targets=sum(p.dropped_no_targets for p in parts),
        rows=2 * len(out),
        tokens=out.n_tokens,
        target_tokens=out.target_tokens(),
        seq_len=data.seq_len,
        identical=sum(p.identical for p in parts),
        kind="kto records" if kto else "pairs",
    )
    return out


# ---------------------------------------------------------------- warnings for people


def pair_truncation_warning(train_set) -> str | None:
    """A warning for people when training pairs (KTO records) were cut to data.seq_len, or left out for their length
    or for an answer with no token left (PairStats); None when none were, or the set is not one of pairs."""
    stats = getattr(train_set, "stats", None)
    if not isinstance(stats, PairStats) or not (stats.truncated or stats.dropped_too_long or stats.dropped_no_targets):
        return None
    total = stats.samples + stats.dropped_too_long + stats.dropped_no_targets
    said = []
    if stats.truncated:
        said.append(
            f"{stats.truncated} cut to data.seq_len {stats.seq_len} (the prompt's start, then the answer's end)"
        )
    if stats.dropped_too_long:
        said.append(f"{stats.dropped_too_long} longer than {stats.seq_len} tokens left out (data.truncation: drop)")
    if stats.dropped_no_targets:
        said.append(f"{stats.dropped_no_targets} left out with no answer token within {stats.seq_len} tokens")
    return (
        f"of {total} training {stats.kind}, {'; '.join(said)} — raise data.seq_len to train on them whole, or "
        "shorten the prompts"
    )


def identical_pairs_warning(noted: list[tuple[DatasetSpec, Tokenized]]) -> str | None:
    """A warning for people when preference records have the same chosen and rejected answer: nothing to prefer,
    so they are left out of training; how many per dataset, the first one's line. noted: mixture.noted_datasets."""
    said = list(
        dict.fromkeys(  # a file that is both data.train and data.validation said once
            f"{count} pair{'s' if count != 1 else ''} of {spec.path} (the first at line {line})"
            for spec, tokenized in noted
            if spec.type == "preference" and tokenized.identical
            for count, line in [tokenized.identical]
        )
    )
    if not said:
        return None
    return (
        f"{'; '.join(said)}: the chosen and the rejected answer are the same, nothing to prefer, so those pairs are "
        "left out of training — fix or remove those records"
    )
