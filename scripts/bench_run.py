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
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from memtrain.train.runtime.distributed import without_rank_variables
from scripts.bench_common import ROOT, GiB, machine_name, run_dir_for, upsert_row

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
]


def run_case(name: str, spec: str, runs: Path, timeout_s: int, warmup_steps: int) -> dict:
    recipe, *overrides = shlex.split(spec)
    run_dir = run_dir_for(runs, name)
    overrides += [f"train.output_dir={run_dir}", "train.log_every=1"]
    command = [sys.executable, "-m", "memtrain", "run", recipe, *overrides, "--no-resume", "--no-save"]
    shown = "memtrain run " + " ".join(shlex.quote(c) for c in [recipe, *overrides[:-2]])
    row = {"recipe": name, "command": shown, "machine": machine_name(), "date": dt.date.today().isoformat()}
    started = time.time()
    log = runs / f"{name}.log"
    runs.mkdir(parents=True, exist_ok=True)
    try:
        with log.open("w") as stream:
            done = subprocess.run(
                command,
                cwd=ROOT,
                stdout=stream,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
                env=without_rank_variables(os.environ),
            )
        status = "ok" if done.returncode == 0 else f"rc {done.returncode}"
    except subprocess.TimeoutExpired:
        status = "timeout"
    metrics = run_dir / "metrics.jsonl"
    records = (
        [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    )
    train = [r for r in records if r["kind"] == "train"]
    if "out of memory" in log.read_text(errors="replace").lower() and status != "ok":
        status = "OOM"
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


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", action="append", required=True, help="NAME=RECIPE [key=value ...]")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", type=Path, default=Path("/tmp/memtrain-bench"))
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--warmup-steps", type=int, default=3, help="steps left out of tokens/s")
    parser.add_argument("--title", default="memtrain run benchmarks")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    for case in args.case:
        name, _, spec = case.partition("=")
        row = run_case(name, spec, args.runs, args.timeout, args.warmup_steps)
        print(json.dumps(row), flush=True)
        upsert_row(args.out, row, COLUMNS, args.title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
