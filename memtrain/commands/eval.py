"""`memtrain eval RUN_DIR`: a finished run's held-out loss and the exact match of its greedy answers (a preference
run: the held-out pairs' reward accuracy and margin too), for people (a table and a few samples) or machines
(--json). The numbers come from memtrain.train.score_run. With --tasks, lm-evaluation-harness tasks instead
(memtrain.commands.benchmark)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from memtrain.commands.benchmark import benchmark_run
from memtrain.errors import Problem, UserError
from memtrain.monitor.perplexity import perplexity_text
from memtrain.train.progress_bar import bars
from memtrain.train.score_run import RunEvaluation, evaluate_run


def eval_command(
    run_dir: Path,
    as_json: bool,
    samples: int,
    limit: int | None,
    console: Console,
    tasks: list[str] | None = None,
    include_path: Path | None = None,
) -> int:
    """Score the run's final model; print a table (or JSON with `as_json`); return the exit code."""
    if tasks:
        return _benchmark(run_dir, as_json, limit, console, tasks, include_path)
    if samples < 0:
        raise UserError(Problem(f"--samples must be 0 or more, got {samples}", hint="e.g. --samples 5"))
    if limit is not None and limit < 1:
        raise UserError(
            Problem(
                f"--limit must be 1 or more, got {limit}", hint="leave it out to answer every held-out conversation"
            )
        )
    with bars() as show:  # minutes on a CPU for a few thousand held-out questions: say how far it got
        result = evaluate_run(
            Path(run_dir),
            limit=limit,
            keep_samples=samples,
            on_answers=lambda done, total: show("answering held-out questions", done, total),
        )
    if as_json:
        console.out(json.dumps(result.as_json(), indent=2), highlight=False)
    else:
        _print(result, console)
    return 0


def _benchmark(
    run_dir: Path, as_json: bool, limit: int | None, console: Console, tasks: list[str], include_path: Path | None
) -> int:
    scores = benchmark_run(Path(run_dir), tasks, include_path=include_path, limit=limit)
    if as_json:
        console.out(json.dumps({"run_dir": str(run_dir), "benchmarks": scores}, indent=2), highlight=False)
        return 0
    table = Table(title=f"lm-evaluation-harness — {run_dir}", title_justify="left")
    for column in ("task", "metric", "value"):
        table.add_column(column)
    for task, values in scores.items():
        for name, value in values.items():
            table.add_row(task, name, f"{value:.4f}")
    console.print(table)
    return 0


def _print(result: RunEvaluation, console: Console) -> None:
    table = Table(title=f"Evaluation — {result.run_dir}", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    if result.pairs is None:
        table.add_row(
            "validation loss",
            f"{result.loss:.4f} (perplexity {perplexity_text(result.loss)}; over "
            f"{result.validation_target_tokens} target tokens in {result.validation_rows} rows)",
        )
    else:  # a preference run: its loss over held-out pairs, and how often the chosen answer wins
        p = result.pairs
        table.add_row("validation loss", f"{result.loss:.4f} (preference loss over {result.validation_rows} pairs)")
        if "reward_accuracy" in p:
            table.add_row("reward accuracy", f"{p['reward_accuracy']:.3f} (chosen rewarded above rejected)")
        if "reward_margin" in p:
            table.add_row(
                "reward margin",
                f"{p['reward_margin']:.4f} (chosen {p['reward_chosen']:.4f}, rejected {p['reward_rejected']:.4f})",
            )
    g = result.generation
    if g is not None:
        table.add_row(
            "exact match",
            f"{g.exact_match:.3f} ({g.answers_said()}" + (f", {g.skipped} skipped" if g.skipped else "") + ")",
        )
        for task, score in g.by_task.items():
            table.add_row(f"  {task}", f"{score:.3f}")
    console.print(table)
    if result.note:
        console.print(f"[yellow]![/] {result.note}", highlight=False)
    if g is not None and g.samples:
        samples = Table(title="Samples", title_justify="left")
        for column in ("question", "expected", "generated", ""):
            samples.add_column(column, overflow="fold")
        for s in g.samples:
            samples.add_row(s.question, s.expected, s.generated, "[green]✓[/]" if s.correct else "[red]✗[/]")
        console.print(samples)
