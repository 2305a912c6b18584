"""`memtrain report RUN_DIR`: the plots beside the run's metrics and a summary for people (a table) or
machines (--json). The numbers come from memtrain.monitor.report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from memtrain.monitor.report import MEMORY_VIEWER_URL, load_run, summarize_records
from memtrain.units import GiB


def report_command(run_dir: Path, as_json: bool, console: Console) -> int:
    """Render the plots into `run_dir`, print the summary (a table, or JSON with `as_json`); return the exit code."""
    from memtrain.monitor.plots import render_plots  # matplotlib: imported by the command that draws, not by the CLI

    run_dir, records, bad_lines = load_run(Path(run_dir))
    summary = summarize_records(records, run_dir, bad_lines)
    summary["plots"] = [str(path) for path in render_plots(records, run_dir)]
    if as_json:
        console.out(json.dumps(summary, indent=2), highlight=False)
    else:
        _print_summary(summary, console)
    return 0


def _token_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """Real tokens (padding left out), the loss's target tokens (with chat data and its prompts masked, a fraction
    of them) and the padding computed. A run from before the three counts recorded its target tokens alone."""

    def count(value):
        return f"{value:,}" if value is not None else "-"

    if summary["tokens_are_targets"]:
        return [("target tokens (the loss's)", count(summary["tokens"]))]
    share = summary["padding_share"]
    padding = f"{share:.1%} of {summary['padded_tokens']:,} positions computed" if share is not None else "-"
    return [
        ("tokens (real, no padding)", count(summary["tokens"])),
        ("target tokens (the loss's)", count(summary["target_tokens"])),
        ("padding", padding),
    ]


def _speed(summary: dict[str, Any]) -> str:
    """The median real tokens/s and target tokens/s (target tokens/s alone for a run from before the counts)."""
    if not summary["median_tokens_per_s"]:
        return "-"
    if summary["tokens_are_targets"]:
        return f"{summary['median_tokens_per_s']:,.0f} target tokens/s"
    targets = summary["median_target_tokens_per_s"]
    return f"{summary['median_tokens_per_s']:,.0f} tokens/s" + (f" ({targets:,.0f} target tokens/s)" if targets else "")


def _print_summary(summary: dict[str, Any], console: Console) -> None:
    title = f"Run {summary['name']}" if summary["name"] else "Run"
    table = Table(title=f"{title} — {summary['run_dir']}", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    table.add_row(
        "status", summary["status"] + (f" (started {summary['starts']} times)" if summary["starts"] > 1 else "")
    )
    table.add_row("device", str(summary["device"] or "?"))
    table.add_row("steps", f"{summary['steps']:,}")
    for what, value in _token_rows(summary):
        table.add_row(what, value)
    table.add_row("wall time", _duration(summary["wall_time_s"]))
    table.add_row("command to first step", _startup(summary))
    table.add_row("speed (median)", _speed(summary))
    table.add_row("final train loss", _number(summary["final_loss"], "{:.4f}", f" (step {summary['final_loss_step']})"))
    table.add_row(
        "best validation perplexity",
        _number(summary["best_eval_perplexity"], "{:.3f}", f" (step {summary['best_eval_step']})"),
    )
    table.add_row("held-out exact match", _exact_match(summary))
    if summary.get("final_reward_accuracy") is not None:  # a preference run
        table.add_row("held-out reward accuracy", _reward_accuracy(summary))
    table.add_row("peak GPU reserved", _peak_vs_plan(summary))
    table.add_row("peak host RSS", _gib(summary["peak_host_rss_bytes"]))
    table.add_row(
        "micro-batch",
        f"{summary['final_micro_batch']} ({summary['batch_changes']} changes)"
        if summary["final_micro_batch"] is not None
        else "-",
    )
    if summary["skipped_steps"] is not None:
        table.add_row("fp16 skipped steps", f"{summary['skipped_steps']} (loss scale {summary['final_loss_scale']})")
    table.add_row("out-of-memory events", f"[red]{summary['oom_count']}[/]" if summary["oom_count"] else "0")
    console.print(table)
    for oom in summary["ooms"]:
        where = f"snapshot {oom['snapshot']} (open it at {MEMORY_VIEWER_URL})" if oom["snapshot"] else "no snapshot"
        console.print(
            f"[red]OOM[/] at step {oom['step']} with micro-batch {oom['micro_batch']}: {where}",
            highlight=False,
            soft_wrap=True,
        )
    if summary["unreadable_lines"]:
        more = summary["unreadable_lines"] - len(summary["unreadable_at"])
        console.print(
            f"[yellow]skipped {summary['unreadable_lines']} unreadable line(s) ({', '.join(summary['unreadable_at'])}"
            f"{f' and {more} more' if more else ''}: a killed run's last write, or a line that is not a record "
            "with a kind and a whole-number step)[/]",
            highlight=False,
            soft_wrap=True,
        )
    if summary.get("plots"):
        console.print("plots: " + ", ".join(summary["plots"]), highlight=False, soft_wrap=True)


def _exact_match(summary: dict[str, Any]) -> str:
    """The first and last generation scores (train.eval_generate): what the training did to the answers."""
    if summary["final_exact_match"] is None:
        return "- (train.eval_generate is off, or the data has no answers)"
    final = f"{summary['final_exact_match']:.3f} at step {summary['final_exact_match_step']}"
    if summary["first_exact_match_step"] != summary["final_exact_match_step"]:
        final = f"{summary['first_exact_match']:.3f} at step {summary['first_exact_match_step']} → {final}"
    return final + (f" ({summary['exact_match_answers']} answers)" if summary["exact_match_answers"] else "")


def _reward_accuracy(summary: dict[str, Any]) -> str:
    """A preference run's held-out reward accuracy from its first to its last evaluation, and the last margin."""
    final = f"{summary['final_reward_accuracy']:.3f} at step {summary['final_reward_accuracy_step']}"
    if summary["first_reward_accuracy_step"] != summary["final_reward_accuracy_step"]:
        final = f"{summary['first_reward_accuracy']:.3f} at step {summary['first_reward_accuracy_step']} → {final}"
    return final + f" (margin {summary['final_reward_margin']:.4f})"


def _peak_vs_plan(summary: dict[str, Any]) -> str:
    if summary["peak_gpu_reserved_bytes"] is None:
        return "- (no GPU memory recorded)"
    text = _gib(summary["peak_gpu_reserved_bytes"])
    if summary["plan_peak_reserved_bytes"]:
        text += f" vs {_gib(summary['plan_peak_reserved_bytes'])} planned ({summary['peak_reserved_over_plan']:.0%})"
    if summary["gpu_cap_bytes"]:
        text += f", cap {_gib(summary['gpu_cap_bytes'])}"
    return text


def _startup(summary: dict[str, Any], shown: int = 3) -> str:
    """The latest start's seconds to its first optimizer step, with its longest phases (metrics' `startup`)."""
    if summary["first_step_s"] is None:
        return "-"
    longest = sorted(summary["startup_phases_s"].items(), key=lambda item: -item[1])[:shown]
    phases = ", ".join(f"{name.replace('_', ' ')} {seconds:.1f} s" for name, seconds in longest)
    return f"{summary['first_step_s']:.1f} s" + (f" (longest: {phases})" if phases else "")


def _gib(value: float | None) -> str:
    return f"{value / GiB:.2f} GiB" if value else "-"


def _number(value: float | None, pattern: str, suffix: str) -> str:
    return pattern.format(value) + suffix if value is not None else "-"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
