"""Benchmark `memtrain run` on recipes: tokens/s, peak GPU memory, host RSS, time to first step.

Each case runs `python -m memtrain run RECIPE OVERRIDES --no-resume` in a subprocess and reads its
metrics.jsonl; rows are appended to a CSV (one row per case, with the command, machine and date)
and a Markdown view is rewritten from the whole CSV.

    python -m scripts.bench_run --out benchmarks/runs.csv \
        --case "1.1b-full-opt-offload=recipes/tinyllama-1.1b-full-offload-24gb.yaml train.steps=20"
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

from memtrain.monitor.metrics import METRICS_FILE, read_metrics
from scripts.bench_common import GiB, machine_name, run_dir_for, run_logged, run_status, upsert_row

COLUMNS = [
    "recipe",
    "tokens_per_s",
    "peak_allocated_gib",
    "peak_reserved_gib",
    "host_peak_rss_gib",
    "time_to_first_step_s",
    "steps",
    "status",
    "machine",
    "date",
    "command",
    "save_s",
]


def run_case(name: str, spec: str, runs: Path, timeout_s: int, warmup_steps: int, resume_at: int | None = None) -> dict:
    """One case's row. With `resume_at`, the run stops after that step with a checkpoint and a second process resumes
    it to the end: the row is the resumed run's, with the save's seconds, and its status says whether it resumed."""
    recipe, *overrides = shlex.split(spec)
    run_dir = run_dir_for(runs, name)
    overrides += [f"train.output_dir={run_dir}", "train.log_every=1"]
    shown = "memtrain run " + " ".join(shlex.quote(c) for c in [recipe, *overrides[:-2]])
    commands = [[sys.executable, "-m", "memtrain", "run", recipe, *overrides, "--no-resume", "--no-save"]]
    if resume_at:
        shutil.rmtree(run_dir, ignore_errors=True)  # a saving run starts in an empty directory, not over the last one
        saving = [*overrides, f"train.save_every={resume_at}"]
        commands = [
            [sys.executable, "-m", "memtrain", "run", recipe, *saving, "--no-resume", "--max-steps", str(resume_at)],
            [sys.executable, "-m", "memtrain", "run", recipe, *saving, "--resume"],
        ]
        shown += f" train.save_every={resume_at} --max-steps {resume_at}, then again with --resume"
    row = {"recipe": name, "command": shown, "machine": machine_name(), "date": dt.date.today().isoformat()}
    log = runs / f"{name}.log"
    runs.mkdir(parents=True, exist_ok=True)
    with log.open("w") as stream:
        for command in commands:
            started = time.time()
            status = run_status(run_logged(command, stream, timeout_s))
            if status != "ok":
                break
    if "out of memory" in log.read_text(errors="replace").lower() and status != "ok":
        status = "OOM"
    metrics = run_dir / METRICS_FILE
    records = read_metrics(metrics) if metrics.exists() else []  # a torn last line (a run timed out) is skipped
    if resume_at:
        row["save_s"] = _save_seconds(records, resume_at) or ""
        status, records = _resumed(records, resume_at, status)
    train = [r for r in records if r["kind"] == "train"]
    row.update(status=status, steps=len(train))
    if train:
        row["time_to_first_step_s"] = f"{train[0]['time'] - started:.1f}"
        row["peak_allocated_gib"] = f"{max(r.get('gpu_peak_allocated_bytes', 0) for r in train) / GiB:.2f}"
        row["peak_reserved_gib"] = f"{max(r.get('gpu_peak_reserved_bytes', 0) for r in train) / GiB:.2f}"
        row["host_peak_rss_gib"] = f"{max(r.get('host_peak_rss_bytes', 0) for r in train) / GiB:.1f}"
        timed = train[warmup_steps:]
        if len(timed) >= 2:
            tokens = timed[-1]["tokens"] - timed[0]["tokens"]
            seconds = timed[-1]["time"] - timed[0]["time"]
            row["tokens_per_s"] = f"{tokens / seconds:.0f}"
        else:
            row["tokens_per_s"] = f"{statistics.median(r['tokens'] / max(r['step_time_s'], 1e-9) for r in train):.0f}"
    return row


def _resumed(records: list[dict], resume_at: int, status: str) -> tuple[str, list[dict]]:
    """The resumed run's records (those after its resume record), and the status: ok only where the second process
    resumed from the checkpoint of step `resume_at`."""
    starts = [i for i, r in enumerate(records) if r["kind"] == "run" and r.get("event") in ("start", "resume")]
    last = records[starts[-1]] if starts else None
    if status != "ok":
        saved = any(r["kind"] == "checkpoint" and r["step"] == resume_at for r in records)
        return f"{status} ({'after' if saved else 'before'} the checkpoint of step {resume_at})", []
    if last is None or last.get("event") != "resume" or last["step"] != resume_at:
        where = "started over" if last is None or last.get("event") == "start" else f"resumed at step {last['step']}"
        return f"{where}, not at step {resume_at}", []
    return "ok", records[starts[-1] :]


def _save_seconds(records: list[dict], resume_at: int) -> str | None:
    """Seconds from the train record of step `resume_at` to its checkpoint record: the save as the run waited for it."""
    train = next((r for r in records if r["kind"] == "train" and r["step"] == resume_at), None)
    saved = next((r for r in records if r["kind"] == "checkpoint" and r["step"] == resume_at), None)
    return f"{saved['time'] - train['time']:.1f}" if train and saved else None


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", action="append", required=True, help="NAME=RECIPE [key=value ...]")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", type=Path, default=Path("/tmp/memtrain-bench"))
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--warmup-steps", type=int, default=3, help="steps left out of tokens/s")
    parser.add_argument("--title", default="memtrain run benchmarks")
    parser.add_argument("--resume-at", type=int, help="stop after this step with a checkpoint, then resume to the end")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    for case in args.case:
        name, _, spec = case.partition("=")
        row = run_case(name, spec, args.runs, args.timeout, args.warmup_steps, args.resume_at)
        print(json.dumps(row), flush=True)
        upsert_row(args.out, row, COLUMNS, args.title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
