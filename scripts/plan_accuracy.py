"""Accuracy of `memtrain plan` against real runs on a GPU (run on the GPU machine, not in CI).

Each case is a ready recipe from recipes/ plus overrides; it is planned, then trained for a few
steps with `python -m memtrain run` in a subprocess under the target card's cap, and the peaks the
run logs in <run_dir>/metrics.jsonl (records of kind "train") are compared with the prediction.
A run that fails with CUDA out-of-memory is a row saying so.

    python scripts/plan_accuracy.py --out benchmarks/plan_accuracy.csv            # all cases
    python scripts/plan_accuracy.py --only tinyllama --calibrate                  # a subset + constants

Writes the CSV (recipe,predicted_reserved_gib,measured_reserved_gib,predicted_allocated_gib,
measured_allocated_gib,predicted_host_gib,measured_host_gib,machine,date) and a Markdown view next
to it (same name, .md), and prints the calibration constants the rows suggest for configs/gpus.
"""
from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import platform
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memtrain.plan.planner import plan_recipe  # noqa: E402
from memtrain.recipe.load import load_recipe  # noqa: E402

GiB = 1024**3
COLUMNS = ["recipe", "predicted_reserved_gib", "measured_reserved_gib", "predicted_allocated_gib",
           "measured_allocated_gib", "predicted_host_gib", "measured_host_gib", "machine", "date"]


@dataclass(frozen=True)
class Case:
    name: str
    recipe: str
    overrides: tuple[str, ...]


def _batch(micro: int, seq: int) -> tuple[str, ...]:
    return (f"batch.micro_batch={micro}", f"batch.global_batch={micro * 2}", f"data.seq_len={seq}")


TINY, OPEN3B = "recipes/tinyllama-1.1b-full-offload-24gb.yaml", "recipes/openllama-3b-full-offload-24gb.yaml"
LORA7B, FULL7B, NVME7B = ("recipes/llama2-7b-lora-24gb.yaml", "recipes/llama2-7b-full-offload-2x24gb.yaml",
                          "recipes/llama2-7b-nvme-24gb.yaml")
CASES = [
    Case("1.1b-opt-cpu-every-mb4-s1024", TINY, _batch(4, 1024)),
    Case("1.1b-no-offload-every-mb4-s1024", TINY, ("offload.optimizer=none",) + _batch(4, 1024)),
    Case("1.1b-opt-cpu-none-mb2-s512", TINY, ("checkpointing.strategy=none",) + _batch(2, 512)),
    Case("1.1b-opt-cpu-every2-mb8-s1024", TINY, ("checkpointing.strategy=every_n_layers",
                                                 "checkpointing.every_n_layers=2") + _batch(8, 1024)),
    Case("1.1b-opt-cpu-every-mb1-s4096", TINY, _batch(1, 4096)),
    Case("1.1b-lora-none-mb8-s512", TINY, ("model.lora.r=16", "offload.optimizer=none",
                                           "checkpointing.strategy=none") + _batch(8, 512)),
    Case("1.1b-opt-cpu-unchunked-mb4-s1024", TINY, ("precision.chunked_loss=false",) + _batch(4, 1024)),
    Case("3b-zero2-opt-cpu-every-mb4-s1024", OPEN3B, ("offload.params=none",) + _batch(4, 1024)),
    Case("3b-zero3-cpu-every-mb4-s1024", OPEN3B, _batch(4, 1024)),
    Case("3b-lora-every-mb4-s2048", OPEN3B, ("model.lora.r=16", "offload.optimizer=none", "offload.params=none")
         + _batch(4, 2048)),
    Case("7b-lora-every-mb4-s1024", LORA7B, _batch(4, 1024)),
    Case("7b-lora-every2-mb8-s512", LORA7B, ("checkpointing.strategy=every_n_layers",
                                             "checkpointing.every_n_layers=2") + _batch(8, 512)),
    Case("7b-lora-every-mb1-s4096", LORA7B, _batch(1, 4096)),
    Case("7b-zero3-cpu-bf16master-mb2-s1024", FULL7B, ("hardware.gpus=1",) + _batch(2, 1024)),
    Case("7b-zero2-opt-cpu-mb2-s1024", FULL7B, ("hardware.gpus=1", "offload.params=none", "offload.zero_stage=auto")
         + _batch(2, 1024)),
    Case("7b-nvme-mb2-s1024", NVME7B, _batch(2, 1024)),
]


def measure(case: Case, overrides: list[str], run_dir: Path, timeout_s: int) -> dict | str:
    """Train a few steps; the max of the logged peaks, or 'OOM' / 'failed (rc N)'."""
    command = [sys.executable, "-m", "memtrain", "run", case.recipe, *overrides, "--no-resume", "--no-save"]
    log = run_dir.with_suffix(".log")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        with log.open("w") as stream:
            done = subprocess.run(command, cwd=ROOT, stdout=stream, stderr=subprocess.STDOUT, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "timeout"
    text = log.read_text(errors="replace")
    if done.returncode != 0:
        return "OOM" if "out of memory" in text.lower() else f"failed (rc {done.returncode})"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("kind") == "train"]
    if not train:
        return "no train records"
    keys = ("gpu_peak_reserved_bytes", "gpu_peak_allocated_bytes", "host_peak_rss_bytes")
    return {key: max(r.get(key) or 0 for r in train) for key in keys}


def cuda_context_bytes() -> int | None:
    """Device memory in use by a process that has only initialised CUDA (not counted by the allocator)."""
    probe = ("import torch; torch.zeros(1, device='cuda'); free, total = torch.cuda.mem_get_info(); "
             "print(total - free - torch.cuda.memory_reserved())")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return int(done.stdout.strip()) if done.returncode == 0 else None


def markdown(rows: list[dict]) -> str:
    lines = ["# `memtrain plan` accuracy", "",
             "Predicted vs measured peak memory per GPU (GiB) and host RSS; error = predicted / measured − 1.", "",
             "| recipe | reserved pred | reserved meas | error | allocated pred | allocated meas | host pred | host meas |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        measured = row["measured_reserved_gib"]
        error = f"{float(row['predicted_reserved_gib']) / float(measured) - 1:+.1%}" \
            if _is_number(measured) and float(measured) > 0 else "—"
        lines.append(f"| {row['recipe']} | {row['predicted_reserved_gib']} | {measured} | {error} | "
                     f"{row['predicted_allocated_gib']} | {row['measured_allocated_gib']} | "
                     f"{row['predicted_host_gib']} | {row['measured_host_gib']} |")
    if rows:
        lines += ["", f"Machine: {rows[0]['machine']}, {rows[0]['date']}."]
    return "\n".join(lines) + "\n"


def _is_number(value) -> bool:
    try:
        float(value)
        return True
    except (TypeError, ValueError):
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "plan_accuracy.csv")
    parser.add_argument("--gpu", default="rtx3090", help="target card the runs are capped to (profile or size)")
    parser.add_argument("--runs", type=Path, default=Path("/tmp/memtrain-plan-accuracy"))
    parser.add_argument("--nvme-path", default="/tmp/memtrain-nvme")
    parser.add_argument("--only", default="", help="run only cases whose name contains one of these comma-separated strings")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    parser.add_argument("--markdown", type=Path, default=None, help="Markdown view (default: --out with .md)")
    parser.add_argument("--plan-only", action="store_true", help="print the predictions without running (no GPU)")
    parser.add_argument("--calibrate", action="store_true", help="also measure the CUDA context; print constants")
    args = parser.parse_args()

    machine = f"{platform.node()} ({args.gpu} cap)"
    date = dt.date.today().isoformat()
    rows, slack = [], []
    wanted = [part for part in args.only.split(",") if part] or [""]
    for case in [c for c in CASES if any(part in c.name for part in wanted)]:
        overrides = [*case.overrides, f"hardware.gpu={args.gpu}", "hardware.cap_memory=true", "train.steps=3",
                     "schedule.warmup_steps=1",
                     "train.eval_every=1000", "train.save_every=1000", "train.log_every=1",
                     f"train.output_dir={args.runs / case.name}"]
        if "nvme" in case.recipe:
            overrides.append(f"hardware.nvme_path={args.nvme_path}")
        plan = plan_recipe(load_recipe(ROOT / case.recipe, overrides, check=False), args.gpu)
        if args.plan_only:
            print(f"{case.name:40s} plan {plan.peak_reserved_bytes / GiB:7.2f} GiB reserved "
                  f"({plan.peak_phase}, {'fits' if plan.fits else 'misses'}), host {plan.host_bytes / GiB:.1f} GiB")
            continue
        measured = measure(case, overrides, args.runs / case.name, args.timeout)
        row = {"recipe": case.name, "predicted_reserved_gib": f"{plan.peak_reserved_bytes / GiB:.2f}",
               "predicted_allocated_gib": f"{plan.peak_allocated_bytes / GiB:.2f}",
               "predicted_host_gib": f"{plan.host_bytes / GiB:.1f}", "machine": machine, "date": date}
        if isinstance(measured, str):
            row.update(measured_reserved_gib=measured, measured_allocated_gib=measured, measured_host_gib=measured)
        else:
            row.update(measured_reserved_gib=f"{measured['gpu_peak_reserved_bytes'] / GiB:.2f}",
                       measured_allocated_gib=f"{measured['gpu_peak_allocated_bytes'] / GiB:.2f}",
                       measured_host_gib=f"{measured['host_peak_rss_bytes'] / GiB:.1f}")
            if measured["gpu_peak_allocated_bytes"]:
                slack.append(measured["gpu_peak_reserved_bytes"] / measured["gpu_peak_allocated_bytes"] - 1)
        verdict = "fits" if plan.fits else "misses"
        print(f"{case.name:40s} plan {row['predicted_reserved_gib']:>7} GiB ({verdict})  "
              f"measured {row['measured_reserved_gib']:>7}", flush=True)
        rows.append(row)

    if args.plan_only:
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.out.exists():  # keep rows of cases not run this time (the matrix may be run in parts)
        ran = {row["recipe"] for row in rows}
        rows = [row for row in csv.DictReader(args.out.open()) if row["recipe"] not in ran] + rows
    with args.out.open("w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    view = args.markdown or args.out.with_suffix(".md")
    view.parent.mkdir(parents=True, exist_ok=True)
    view.write_text(markdown(rows))
    print(f"wrote {args.out} and {view}")
    if args.calibrate:
        context = cuda_context_bytes()
        print("suggested constants for configs/gpus/<card>.yaml:")
        if context is not None:
            print(f"  cuda_context: {context / GiB:.2f}GiB")
        if slack:
            print(f"  allocator_slack_ratio: {statistics.median(slack):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
