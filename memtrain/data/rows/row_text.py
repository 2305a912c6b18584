"""What the model trains on, row by row: the text of each row's samples, split where the loss starts or stops.

A row (what one batch slot holds: `data.seq_len` tokens) is one text window, or with instruction and chat data
one or more whole samples packed together. A token is a *target* when the loss trains the model to write it:
its label is not -100 and it is not the first token of a sample (nothing before it in the sample predicts it;
the loss shifts labels by one). Packed samples restart their position ids at 0, which is how a row's samples
are told apart here, as the attention does.

`row_view` is pure: a dataset item and the tokenizer in, the spans of text out. The spans are decoded a run of
tokens at a time (not token by token), so characters that take several tokens (emoji, accents) come out whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from memtrain.data.rows.dataset import TokenWindows
from memtrain.data.rows.pairs import KtoRows, PairRows
from memtrain.data.rows.row_set import SampleRows
from memtrain.labels import IGNORE_INDEX


@dataclass(frozen=True)
class Span:
    """Consecutive tokens of one sample that are all targets, or all context."""

    text: str
    target: bool  # the loss trains the model to write these tokens
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class SampleView:
    source: str | None  # the dataset it came from (a recipe's data list), None for a text window
    spans: tuple[Span, ...]
    line: int | None = None  # its record's line (or row) in that dataset's file, where known (sample_lines.py)

    @property
    def tokens(self) -> int:
        return sum(len(span.token_ids) for span in self.spans)

    @property
    def target_tokens(self) -> int:
        return sum(len(span.token_ids) for span in self.spans if span.target)


@dataclass(frozen=True)
class RowView:
    index: int
    seq_len: int
    samples: tuple[SampleView, ...]

    @property
    def tokens(self) -> int:
        return sum(sample.tokens for sample in self.samples)

    @property
    def target_tokens(self) -> int:
        return sum(sample.target_tokens for sample in self.samples)

    @property
    def padding_tokens(self) -> int:
        return self.seq_len - self.tokens

    def as_json(self) -> dict:
        return {
            "index": self.index,
            "tokens": self.tokens,
            "target_tokens": self.target_tokens,
            "padding_tokens": self.padding_tokens,
            "samples": [
                {
                    "source": sample.source,
                    "line": sample.line,
                    "tokens": sample.tokens,
                    "target_tokens": sample.target_tokens,
                    "spans": [
                        {"text": span.text, "target": span.target, "token_ids": list(span.token_ids)}
                        for span in sample.spans
                    ],
                }
                for sample in self.samples
            ],
        }


def row_view(
    dataset: TokenWindows | SampleRows,
    index: int,
    tokenizer: PreTrainedTokenizerBase,
    source_names: list[str] | None = None,
    lines: dict[int, int] | None = None,
) -> RowView:
    """Row `index` of `dataset` as text spans. `source_names`: the path of each dataset a SampleRows draws from,
    in the order of its sources (the recipe's data list); `lines`: {sample index: its record's line}
    (sample_lines.py). A pair set's item is its two rows (pairs.py), each shown as a sample named by its role
    (chosen, rejected; a KTO record and its KL row)."""
    if isinstance(dataset, (PairRows, KtoRows)):
        return _pair_view(dataset, index, tokenizer, source_names)
    item, length = dataset[index], int(dataset.lengths[index])
    input_ids = item["input_ids"][:length].tolist()
    labels = item["labels"][:length].tolist()
    positions = item["position_ids"][:length].tolist() if "position_ids" in item else list(range(length))
    starts = [at for at, position in enumerate(positions) if position == 0] or [0]
    ends = [*starts[1:], length]
    in_row = list(dataset.row(index)) if isinstance(dataset, SampleRows) else [None] * len(starts)
    sources = (
        [source_names[int(dataset.samples.source[i])] for i in in_row]
        if isinstance(dataset, SampleRows) and source_names
        else [None] * len(starts)
    )
    samples = []
    for sample, source, start, end in zip(in_row, sources, starts, ends):
        targets = [at > start and labels[at] != IGNORE_INDEX for at in range(start, end)]
        line = (lines or {}).get(sample) if sample is not None else None
        samples.append(SampleView(source, tuple(_spans(input_ids[start:end], targets, tokenizer)), line))
    return RowView(index=index, seq_len=len(item["input_ids"]), samples=tuple(samples))


def _pair_view(dataset, index: int, tokenizer: PreTrainedTokenizerBase, source_names: list[str] | None) -> RowView:
    batch = dataset.collate([index])
    roles = ("chosen", "rejected") if isinstance(dataset, PairRows) else ("record", "KL row")
    views = dataset.views["chosen" if isinstance(dataset, PairRows) else "record"]
    path = source_names[int(views.source[index])] if source_names else None
    samples = []
    for row, role in enumerate(roles):
        length = int(batch["attention_mask"][row].sum())
        ids, labels = batch["input_ids"][row, :length].tolist(), batch["labels"][row, :length].tolist()
        targets = [label != IGNORE_INDEX for label in labels]
        source = f"{role} of {path}" if path else role
        samples.append(SampleView(source, tuple(_spans(ids, targets, tokenizer))))
    return RowView(index=index, seq_len=2 * dataset.seq_len, samples=tuple(samples))


def _spans(ids: list[int], targets: list[bool], tokenizer: PreTrainedTokenizerBase) -> list[Span]:
    spans, start = [], 0
    for at in range(1, len(ids) + 1):
        if at == len(ids) or targets[at] != targets[start]:
            piece = ids[start:at]
            spans.append(
                Span(
                    tokenizer.decode(piece, skip_special_tokens=False, clean_up_tokenization_spaces=False),
                    targets[start],
                    tuple(piece),
                )
            )
            start = at
    return spans
