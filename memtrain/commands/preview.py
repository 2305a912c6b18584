"""`memtrain preview RECIPE`: the first rows of the data as the model will see them, the loss's targets marked.

It answers, before any GPU time, the question a chat fine-tune stands or falls on: does the loss train the
answers and their end-of-turn token, and nothing else? The data is built as `memtrain run` builds it (the same
token cache, template, truncation, packing and row order), so what is shown is what the run trains on.
Targets are bold green (between ⟦ ⟧ where the output has no colour: a file or a pipe); ↵ marks a newline.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.text import Text

from memtrain.checks.load import load_checked
from memtrain.data.rows.row_set import SampleRows
from memtrain.data.rows.row_text import RowView, row_view
from memtrain.data.rows.sample_lines import sample_lines
from memtrain.errors import Problem, UserError
from memtrain.recipe.schema import Data, DatasetSpec
from memtrain.train.progress_bar import tokenising_progress
from memtrain.train.setup import build_data

SPLITS = ("train", "validation")
TARGET_STYLE = "bold green"
CONTEXT_STYLE = "dim"


def preview_command(
    recipe: Path, overrides: list[str], rows: int, start: int, split: str, as_json: bool, console: Console
) -> int:
    if split not in SPLITS:
        raise UserError(Problem(f"must be train or validation, not {split!r}", key="--split"))
    loaded = load_checked(recipe, overrides)
    data_section = loaded.recipe.data
    with tokenising_progress(), loaded.sources.located():  # a bar per file it tokenises, once per data
        data = build_data(loaded.recipe)
    for warning in data.warnings:
        Console(stderr=True).print(f"[yellow]![/] {warning}", highlight=False, soft_wrap=True)
    dataset = data.train_set if split == "train" else data.val_set
    if start >= len(dataset):
        raise UserError(
            Problem(
                f"--start {start} is past the last row of the {split} data ({len(dataset)} rows)",
                hint=f"give --start below {len(dataset)}",
            )
        )
    names = _source_names(data_section, split)
    shown = range(start, min(start + rows, len(dataset)))
    lines = (
        sample_lines(
            dataset, _source_specs(data_section, split), data_section, data.tokenizer, _samples_of(dataset, shown)
        )
        if isinstance(dataset, SampleRows)
        else None
    )
    views = [row_view(dataset, index, data.tokenizer, names, lines) for index in shown]
    if as_json:
        summary = {
            "recipe": loaded.name,
            "split": split,
            "rows_total": len(dataset),
            "data": dataclasses.asdict(dataset.stats),
            "rows": [view.as_json() for view in views],
        }
        sys.stdout.write(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
        return 0
    console.print(f"{split} data of {loaded.name}: {dataset.stats.describe()}", highlight=False, soft_wrap=True)
    marks = console.color_system is None
    legend = "⟦targets⟧" if marks else f"[{TARGET_STYLE}]targets[/]"
    if data_section.holds_pairs:  # a pair is two rows, each its own sequence
        packed = "; each item is a pair's two sequences, computed as rows of their own"
    else:
        packed = "; the samples of one row attend only to themselves" if any(len(v.samples) > 1 for v in views) else ""
    console.print(
        f"{legend}: what the loss trains the model to write; the rest is context it only reads; ↵ a newline{packed}",
        highlight=False,
        soft_wrap=True,
    )
    for view in views:
        _print_row(view, len(dataset), marks, console)
    return 0


def _source_names(data: Data, split: str) -> list[str] | None:
    """The dataset path behind each source index of the split's rows (mixture.py builds them in list order)."""
    if isinstance(data.train, str):
        return None
    return [spec.path for spec in _source_specs(data, split)]


def _source_specs(data: Data, split: str) -> list[DatasetSpec]:
    """The datasets behind the source indices of the split's rows (a recipe with a list of datasets)."""
    return list(data.validation if split == "validation" and data.validation is not None else data.train)


def _samples_of(dataset: SampleRows, rows: range) -> list[int]:
    """The samples the rows hold."""
    return [int(sample) for index in rows for sample in dataset.row(index)]


def _print_row(view: RowView, rows_total: int, marks: bool, console: Console) -> None:
    share = view.target_tokens / view.tokens if view.tokens else 0.0
    console.print()
    console.rule(
        f"row {view.index} of {rows_total}: {len(view.samples)} sample{'s' if len(view.samples) != 1 else ''}, "
        f"{view.tokens} tokens ({view.target_tokens} targets, {share:.0%}), {view.padding_tokens} padding",
        align="left",
    )
    for number, sample in enumerate(view.samples, start=1):
        if len(view.samples) > 1 or sample.source:
            where = (
                f" from {sample.source}" + (f":{sample.line}" if sample.line is not None else "")
                if sample.source
                else ""
            )
            console.print(
                f"[bold]sample {number}[/]{where}: {sample.tokens} tokens, {sample.target_tokens} targets",
                highlight=False,
                soft_wrap=True,
            )
        text = Text()
        for span in sample.spans:
            shown = span.text.replace("\n", "↵\n")
            if span.target:
                text.append(f"⟦{shown}⟧" if marks else shown, style=TARGET_STYLE)
            else:
                text.append(shown, style=CONTEXT_STYLE)
        console.print(text, soft_wrap=True)
