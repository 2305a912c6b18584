"""The summary of a run's metrics.jsonl: the numbers `memtrain report` shows, as data.

Works on a finished run, one still going, and one that was killed (a torn last line is skipped).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from statistics import median
from typing import Any

from memtrain.errors import Problem, UserError
from memtrain.monitor.metrics import GENERATION_KIND, METRICS_FILE, read_metrics_lines
from memtrain.monitor.series import is_start, series, steady_speeds, target_field, tokens_are_targets

MEMORY_VIEWER_URL = "https://pytorch.org/memory_viz"

UNREADABLE_SHOWN = 5  # the first lines that could not be read, named file:line; the rest are counted


def summarize(run_dir: Path) -> dict[str, Any]:
    """The numbers a person asks about first, computed from run_dir/metrics.jsonl.

    Bytes stay bytes and times seconds; None where the run has not recorded that yet.
    """
    run_dir, records, bad_lines = load_run(Path(run_dir))
    return summarize_records(records, run_dir, bad_lines)


def load_run(path: Path) -> tuple[Path, list[dict], list[int]]:
    """(run directory, its metric records, the numbers of the lines that are not records); `path` may be the metrics
    file itself."""
    run_dir = _run_dir_of(path)
    records, bad_lines = _load(run_dir)
    return run_dir, records, bad_lines


def summarize_records(records: list[dict], run_dir: Path, bad_lines: Sequence[int] = ()) -> dict[str, Any]:
    """`summarize` of records already read; bad_lines: the numbers of metrics.jsonl's lines that were skipped."""
    starts = [r for r in records if is_start(r)]
    last_run = next((r for r in reversed(records) if r["kind"] == "run"), None)
    loss_steps, losses = series(records, "train", "loss")
    token_steps, tokens = series(records, "train", "tokens")  # real input tokens; targets in older records
    _, targets = series(records, "train", target_field(records))
    _, padded = series(records, "train", "padded_tokens")
    speeds = steady_speeds(records)
    target_speeds = steady_speeds(records, target_field(records))
    old_counts = tokens_are_targets(records)
    ppl_steps, perplexities = series(records, "eval", "perplexity")
    _, micro_batches = series(records, "train", "micro_batch")
    _, skipped = series(records, "train", "skipped_steps")
    _, loss_scales = series(records, "train", "loss_scale")
    train_steps = [int(r["step"]) for r in records if r["kind"] == "train"]

    best_index = min(range(len(perplexities)), key=perplexities.__getitem__) if perplexities else None
    plan_peak = _last_value(starts, "plan_peak_reserved_bytes")
    peak_reserved = _max_positive(records, "train", ("gpu_peak_reserved_bytes", "gpu_reserved_bytes"))
    ooms = [r for r in records if r["kind"] == "oom"]
    startup = next((r for r in reversed(records) if r["kind"] == "startup"), None)  # the latest start's
    match_steps, matches = series(records, GENERATION_KIND, "exact_match")  # train.eval_generate's scores
    answered = _last_value([r for r in records if r["kind"] == GENERATION_KIND], "total")
    accuracy_steps, accuracies = series(records, "eval", "reward_accuracy")  # a preference run's held-out pairs
    _, margins = series(records, "eval", "reward_margin")
    return {
        "run_dir": str(run_dir),
        "name": _last_value(starts, "recipe") or _last_value(starts, "name"),
        "device": _last_value(starts, "device"),
        "status": last_run.get("status", "running or killed")
        if last_run and last_run.get("event") == "end"
        else "running or killed",
        "starts": len(starts),
        "steps": max(train_steps) if train_steps else 0,
        "tokens": int(tokens[-1]) if tokens else None,
        "tokens_are_targets": old_counts,  # a run from before the three counts: `tokens` are its target tokens
        "target_tokens": int(targets[-1]) if targets else None,
        "padded_tokens": int(padded[-1]) if padded else None,
        # of the positions computed: what padding cost
        "padding_share": 1 - tokens[-1] / padded[-1] if padded and tokens and not old_counts else None,
        "tokens_step": token_steps[-1] if token_steps else None,
        "wall_time_s": _wall_time_s(records),
        "final_loss": losses[-1] if losses else None,
        "final_loss_step": loss_steps[-1] if loss_steps else None,
        "median_tokens_per_s": median(speeds) if speeds else None,
        "median_target_tokens_per_s": median(target_speeds) if target_speeds else None,
        "best_eval_perplexity": perplexities[best_index] if best_index is not None else None,
        "best_eval_step": ppl_steps[best_index] if best_index is not None else None,
        "first_exact_match": matches[0] if matches else None,
        "first_exact_match_step": match_steps[0] if matches else None,
        "final_exact_match": matches[-1] if matches else None,
        "final_exact_match_step": match_steps[-1] if matches else None,
        "exact_match_answers": answered,
        "first_reward_accuracy": accuracies[0] if accuracies else None,
        "first_reward_accuracy_step": accuracy_steps[0] if accuracies else None,
        "final_reward_accuracy": accuracies[-1] if accuracies else None,
        "final_reward_accuracy_step": accuracy_steps[-1] if accuracies else None,
        "final_reward_margin": margins[-1] if margins else None,
        "peak_gpu_reserved_bytes": peak_reserved,
        "peak_gpu_allocated_bytes": _max_positive(
            records, "train", ("gpu_peak_allocated_bytes", "gpu_allocated_bytes")
        ),
        "plan_peak_reserved_bytes": plan_peak,
        "peak_reserved_over_plan": peak_reserved / plan_peak if peak_reserved and plan_peak else None,
        "gpu_cap_bytes": _last_value([r for r in records if r["kind"] in ("run", "train")], "gpu_cap_bytes") or None,
        "peak_host_rss_bytes": _max_positive(records, "train", ("host_peak_rss_bytes", "host_rss_bytes")),
        "final_micro_batch": micro_batches[-1] if micro_batches else None,
        "batch_changes": sum(1 for r in records if r["kind"] == "batch"),
        "oom_count": len(ooms),
        "oom_snapshots": [str(r["snapshot"]) for r in ooms if r.get("snapshot")],
        "ooms": [{"step": r["step"], "micro_batch": r.get("micro_batch"), "snapshot": r.get("snapshot")} for r in ooms],
        "skipped_steps": skipped[-1] if skipped else None,
        "final_loss_scale": loss_scales[-1] if loss_scales else None,
        "checkpoints": [
            str(r["path"])
            for r in records  # those still there (train.keep_last removes old ones)
            if r["kind"] == "checkpoint" and r.get("path") and Path(r["path"]).exists()
        ],
        "unreadable_lines": len(bad_lines),
        "unreadable_at": [f"{METRICS_FILE}:{number}" for number in bad_lines[:UNREADABLE_SHOWN]],
        "first_step_s": startup.get("first_step_s") if startup else None,
        "startup_phases_s": dict(startup.get("phases_s", {})) if startup else {},
    }


def _run_dir_of(path: Path) -> Path:
    """The run directory; a path to its metrics.jsonl is accepted too."""
    if path.is_file() and path.name == METRICS_FILE:
        return path.parent
    if not path.exists():
        raise UserError(
            Problem(
                f"run directory {path} does not exist",
                hint="pass the directory `memtrain run` wrote (the recipe's train.output_dir)",
            )
        )
    if not path.is_dir():
        raise UserError(Problem(f"{path} is not a run directory", hint=f"pass the directory that holds {METRICS_FILE}"))
    return path


def _load(run_dir: Path) -> tuple[list[dict], list[int]]:
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.is_file():
        raise UserError(
            Problem(
                f"no {METRICS_FILE} in {run_dir}",
                hint="pass a run directory of `memtrain run`; a run writes it from its start",
            )
        )
    records, bad_lines = read_metrics_lines(metrics_path)
    unreadable_lines = len(bad_lines)
    if not records:
        raise UserError(
            Problem(
                f"{metrics_path} has no complete records yet ({unreadable_lines} unreadable lines)",
                hint="wait until the run has logged its first steps, then report again",
            )
        )
    return records, bad_lines


def _wall_time_s(records: list[dict]) -> float:
    """Seconds the run was alive: each start (and resume) to its last record, summed; pauses between don't count."""
    total = 0.0
    first = last = None
    for record in records:
        if is_start(record) and first is not None:
            total += last - first
            first = None
        if first is None:
            first = record["time"]
        last = record["time"]
    if first is not None:
        total += last - first
    return total


def _last_value(records: list[dict], field: str) -> Any:
    for record in reversed(records):
        if record.get(field) is not None:
            return record[field]
    return None


def _max_positive(records: list[dict], kind: str, fields: tuple[str, ...]) -> int | None:
    values = [
        record[field]
        for record in records
        if record["kind"] == kind
        for field in fields
        if isinstance(record.get(field), (int, float)) and record[field] > 0
    ]
    return max(values) if values else None
