"""The longest sequence that trains: memtrain against HF Trainer + PEFT (+ Liger) on the same recipe and card.

For each method (memtrain, or a baseline of benchmarks/suites.yaml), the recipe runs a few steps at each length of
--lengths, shortest first, with `data.seq_len=L`; the first length that fails (out of memory, a timeout, any error)
ends that method's ladder, since memory only grows with the length. The longest that trained is the row, with its
tokens/s and peak reserved memory. Rows go to benchmarks/long_context.csv (one per model and method, with the
command, machine and date) and its Markdown view.

    python -m scripts.bench_long_context --out benchmarks/long_context.csv --name llama3-8b-qlora \
        --recipe recipes/llama3-8b-qlora-long-24gb.yaml --methods memtrain,hf,hf-liger \
        --lengths 8192,16384,32768,65536 --steps 4 --warmup 1

A memtrain ladder may start from `memtrain plan --max-seq-len`'s answer; the baselines get the same ladder.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import subprocess
from pathlib import Path

from scripts.bench_common import RUN_FAILURES, machine_name, run_dir_for, upsert_row
from scripts.bench_vs_hf import baseline_names, baseline_side, memtrain_side
from scripts.suites import load_suites

COLUMNS = [
    "model",
    "method",
    "longest_seq_len",
    "tokens_per_s",
    "peak_reserved_gib",
    "failed_at",
    "command",
    "machine",
    "date",
]
TITLE = "The longest sequence that trains, memtrain against HF Trainer + PEFT (+ Liger), same card and call"
MEMTRAIN = "memtrain"


def ladder_command(method: str, spec: str, lengths: list[int], steps: int, warmup: int) -> str:
    """The row's command: this script for one method, as a person re-runs it."""
    return shlex.join(
        [
            "python",
            "-m",
            "scripts.bench_long_context",
            "--recipe",
            spec,
            "--methods",
            method,
            "--lengths",
            ",".join(map(str, lengths)),
            "--steps",
            str(steps),
            "--warmup",
            str(warmup),
        ]
    )


def run_once(
    method: str, recipe: str, overrides: list[str], *, name: str, steps: int, warmup: int, runs: Path, timeout_s: int
):
    """One method's few steps at one length: tokens/s and peak reserved GiB (a RUN_FAILURES exception when it fails).
    Its output goes to runs/NAME.log."""
    if method == MEMTRAIN:
        return memtrain_side(recipe, overrides, steps, warmup, run_dir_for(runs, name), timeout_s)
    baseline = load_suites().baselines[method]
    out = runs / f"{name}.json"
    out.unlink(missing_ok=True)  # a result of an earlier call must not stand for this one
    return baseline_side(baseline, recipe, overrides, steps, warmup, out, timeout_s)


def failure(error: Exception, log: Path) -> str:
    """What ended a length, in words: out of memory where the run's log says so, a timeout, else the log's last line
    (a refusal says why there), or the error's kind where there is no log."""
    if isinstance(error, subprocess.TimeoutExpired):
        return "timeout"
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    if any("OutOfMemoryError" in line or "out of memory" in line.lower() for line in lines):
        return "out of memory"
    last = next((line.strip() for line in reversed(lines) if line.strip()), "")
    return last[:120] or type(error).__name__


def ladder(method: str, spec: str, lengths: list[int], *, steps: int, warmup: int, runs: Path, timeout_s: int) -> dict:
    """Climb the lengths until one fails: the row of the longest that trained."""
    recipe, *overrides = shlex.split(spec)
    row = {"method": method, "longest_seq_len": 0, "failed_at": ""}
    for length in sorted(lengths):
        name = f"{method}-{length}"
        try:
            result = run_once(
                method,
                recipe,
                [*overrides, f"data.seq_len={length}"],
                name=name,
                steps=steps,
                warmup=warmup,
                runs=runs,
                timeout_s=timeout_s,
            )
        except RUN_FAILURES as error:
            row["failed_at"] = f"{length} ({failure(error, runs / f'{name}.log')})"
            break
        row.update(
            longest_seq_len=length,
            tokens_per_s=f"{result['tokens_per_s']:.0f}",
            peak_reserved_gib=f"{result['peak_reserved_gib']:.2f}",
        )
    return row


def methods(text: str) -> list[str]:
    """--methods memtrain,hf,hf-liger: memtrain and the baselines of benchmarks/suites.yaml."""
    return baseline_names(text, "methods", also=(MEMTRAIN,))


def lengths(text: str) -> list[int]:
    try:
        values = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"lengths are token counts, comma-separated, not {text!r}") from None
    if not values or min(values) < 8:
        raise argparse.ArgumentTypeError(f"lengths are token counts of at least 8, comma-separated, not {text!r}")
    return values


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the CSV (benchmarks/long_context.csv)")
    parser.add_argument("--name", required=True, help="the model column: what the recipe trains")
    parser.add_argument("--recipe", required=True, help="RECIPE [key=value ...]")
    parser.add_argument("--methods", type=methods, default=[MEMTRAIN, "hf"], help="memtrain and baselines")
    parser.add_argument("--lengths", type=lengths, required=True, help="data.seq_len values, comma-separated")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1, help="steps left out of tokens/s")
    parser.add_argument("--runs", type=Path, default=Path("/tmp/memtrain-long-context"))
    parser.add_argument("--timeout", type=int, default=600, help="seconds each run may take")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    args.runs.mkdir(parents=True, exist_ok=True)
    for method in args.methods:
        row = ladder(
            method,
            args.recipe,
            args.lengths,
            steps=args.steps,
            warmup=args.warmup,
            runs=args.runs,
            timeout_s=args.timeout,
        )
        row.update(
            model=args.name,
            command=ladder_command(method, args.recipe, args.lengths, args.steps, args.warmup),
            machine=machine_name(),
            date=dt.date.today().isoformat(),
        )
        print(json.dumps(row), flush=True)
        upsert_row(args.out, row, COLUMNS, TITLE, keys=("model", "method"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
