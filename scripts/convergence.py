"""Do the precision and optimizer choices that change the math still learn as fp32 AdamW does?

Each variant trains the same recipe on the same data, in the same order, for the same steps, from the same
initial weights; the validation loss at the end is compared with the reference (fp32 master weights and
fp32 AdamW states). Rows go to a CSV (command, machine, date) and a Markdown view beside it.

    python -m scripts.convergence --out benchmarks/convergence.csv --label cpu-quickstart \\
        --recipe recipes/quickstart.yaml --set batch.global_batch=16 batch.micro_batch=16
    python -m scripts.convergence --out benchmarks/convergence.csv --label gpu-1.1b \\
        --recipe recipes/tinyllama-1.1b-full-offload-24gb.yaml --set train.steps=150 ...

Every variant sets one micro-batch per step and no clipping (optimizer.step_in_backward needs both), so
the only differences are the ones named.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
import time
from pathlib import Path

from memtrain.monitor.metrics import METRICS_FILE, read_metrics
from scripts.bench_common import machine_name, run_dir_for, run_logged, run_status, upsert_row

TOLERANCE = 0.02  # a variant converges alike when its final validation loss is within 2 % of the reference's
COLUMNS = [
    "label",
    "variant",
    "eval_loss",
    "vs_reference",
    "within_2pct",
    "steps",
    "seconds",
    "status",
    "machine",
    "date",
    "command",
]
REFERENCE = "fp32 master + fp32 AdamW"
# name -> overrides; the reference keeps the recipe's compute dtype with fp32 master weights and states
VARIANTS = {
    REFERENCE: ["precision.master=fp32", "offload.optimizer=none"],
    "bf16 master + bf16 states (DeepSpeed CPU Adam)": [
        "precision.compute=bf16",
        "precision.master=bf16",
        "offload.optimizer=cpu",
    ],
    "bf16 weights, AdamW in backward (bf16 states)": [
        "precision.compute=bf16",
        "precision.master=bf16",
        "offload.optimizer=none",
        "offload.zero_stage=0",
        "optimizer.step_in_backward=true",
    ],
    "bf16 weights, paged 8-bit AdamW in backward": [
        "precision.compute=bf16",
        "precision.master=bf16",
        "offload.optimizer=none",
        "offload.zero_stage=0",
        "optimizer.step_in_backward=true",
        "optimizer.name=paged_adamw_8bit",
    ],
}
COMMON = ["optimizer.grad_clip=0", "offload.params=none", "batch.policy=fixed"]


def run_variant(label: str, name: str, recipe: str, settings: list[str], runs: Path, timeout_s: int) -> dict:
    run_dir = run_dir_for(runs, f"{label}-{name}")
    overrides = [*settings, *COMMON, *VARIANTS[name], f"train.output_dir={run_dir}"]
    command = [sys.executable, "-m", "memtrain", "run", recipe, *overrides, "--no-resume", "--no-save"]
    shown = "memtrain run " + " ".join(shlex.quote(c) for c in [recipe, *overrides[:-1]])
    started = time.time()
    runs.mkdir(parents=True, exist_ok=True)
    with (runs / f"{run_dir.name}.log").open("w") as log:
        code = run_logged(command, log, timeout_s)
    status = run_status(code)
    metrics = run_dir / METRICS_FILE
    records = read_metrics(metrics) if metrics.exists() else []
    evals = [r["loss"] for r in records if r["kind"] == "eval"]
    loss = evals[-1] if evals else None
    steps = sum(1 for r in records if r["kind"] == "train")
    return {
        "label": label,
        "variant": name,
        "eval_loss": f"{loss:.4f}" if loss is not None else "",
        "steps": steps,
        "seconds": f"{time.time() - started:.0f}",
        "status": status,
        "machine": machine_name(),
        "date": dt.date.today().isoformat(),
        "command": shown,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--label", required=True, help="names this comparison's rows (e.g. cpu-quickstart)")
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--set", nargs="*", default=[], help="overrides every variant shares")
    parser.add_argument("--runs", type=Path, default=Path("/tmp/memtrain-convergence"))
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    parser.add_argument(
        "--only", default="", help="comma-separated substrings of variant names (reference always runs)"
    )
    args = parser.parse_args()
    wanted = [n for n in VARIANTS if n == REFERENCE or not args.only or any(s in n for s in args.only.split(","))]
    rows = [run_variant(args.label, name, args.recipe, args.set, args.runs, args.timeout) for name in wanted]
    reference = rows[0]["eval_loss"]
    for row in rows:
        if reference and row["eval_loss"]:
            ratio = float(row["eval_loss"]) / float(reference) - 1
            row.update(vs_reference=f"{ratio:+.2%}", within_2pct="yes" if abs(ratio) <= TOLERANCE else "no")
        print(json.dumps(row), flush=True)
        upsert_row(
            args.out,
            row,
            COLUMNS,
            "Convergence of the precision and optimizer choices (final validation loss)",
            keys=("label", "variant"),
        )
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
