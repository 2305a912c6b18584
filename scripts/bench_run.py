"""Benchmark `memtrain run` on recipes: tokens/s, peak GPU memory, host RSS, time to first step.

Each case runs `python -m memtrain run RECIPE OVERRIDES --no-resume` in a subprocess and reads its
metrics.jsonl; rows are appended to a CSV (one row per case, with the command, machine and date)
and a Markdown view is rewritten from the whole CSV.

    python scripts/bench_run.py --out benchmarks/runs.csv \
        --case "1.1b-full-opt-offload=recipes/tinyllama-1.1b-full-offload-24gb.yaml train.steps=20"
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memtrain.train.runtime.distributed import without_rank_variables  # noqa: E402

GiB = 1024**3
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


def machine_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return f"{cpu_name()} CPU"


def cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what platform knows of it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def run_dir_for(runs: Path, name: str) -> Path:
    """A directory for a case whose label may hold spaces, colons or commas (an override would misread them)."""
    return runs / re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")


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


def write_markdown(rows: list[dict], path: Path, title: str, columns: list[str] = COLUMNS) -> None:
    lines = [f"# {title}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(c, "")).replace("|", "\\|") for c in columns) + " |")
    path.write_text("\n".join(lines) + "\n")


def upsert_row(
    out: Path,
    row: dict,
    columns: list[str],
    title: str,
    keys: tuple[str, ...] = ("recipe",),
    defaults: dict | None = None,
) -> None:
    """Replace the row with the same `keys` in the CSV (or add it) and rewrite its Markdown view.

    defaults: values for columns that rows written before the column existed lack."""
    rows = list(csv.DictReader(out.open())) if out.exists() else []
    rows = [{**(defaults or {}), **{k: v for k, v in r.items() if k is not None and v is not None}} for r in rows]
    rows = [r for r in rows if any(r.get(k) != row.get(k) for k in keys)] + [row]
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    write_markdown(rows, out.with_suffix(".md"), title, columns)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", action="append", required=True, help="NAME=RECIPE [key=value ...]")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", type=Path, default=Path("/tmp/memtrain-bench"))
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--warmup-steps", type=int, default=3, help="steps left out of tokens/s")
    parser.add_argument("--title", default="memtrain run benchmarks")
    args = parser.parse_args()
    for case in args.case:
        name, _, spec = case.partition("=")
        row = run_case(name, spec, args.runs, args.timeout, args.warmup_steps)
        print(json.dumps(row), flush=True)
        upsert_row(args.out, row, COLUMNS, args.title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
