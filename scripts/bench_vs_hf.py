"""memtrain against Hugging Face Trainer + DeepSpeed, side by side in one invocation.

For each case: `memtrain run` on the recipe, then each baseline (scripts/hf_baseline.py) on the same recipe (same
shape, data, global batch, precision, checkpointing, offload tiers, memory cap; for chat data the same
templated, masked, packed rows in the same order). Tokens/s counts row positions (global batch ×
seq_len per step) over the steps after the warm-up, for both; target tokens/s counts the positions the
loss is computed on (for chat data, the responses), also for both, from memtrain's rows.
Appends to benchmarks/vs_hf.csv and rewrites its Markdown view.

    python -m scripts.bench_vs_hf --out benchmarks/vs_hf.csv --steps 12 --warmup 3 \
        --case "1.1b-full-opt-offload=recipes/tinyllama-1.1b-full-offload-24gb.yaml"

Overrides after a `::` in a case apply to memtrain only (its levers: a planner-chosen micro-batch or
checkpointing); the global batch must stay the same. Cases with the same recipe and shared overrides
run each baseline once per invocation and share its numbers.

--baseline hf,hf-liger runs memtrain once per case and each baseline after it, one row per baseline
(the `baseline` column; the hf_* columns are that baseline's numbers, whichever it is). The baselines are
those of benchmarks/suites.yaml (`baselines:`): hf is HF Trainer eager, hf-liger the same with
`use_liger_kernel=True` (Liger's fused linear cross-entropy, RMSNorm, SwiGLU and RoPE); a new one is a few
lines there, naming its script (the contract: scripts/suites.py, Baseline).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from memtrain.plan.planner import describe_checkpointing
from memtrain.recipe.load import load_recipe
from memtrain.recipe.schema import Checkpointing
from memtrain.train.runtime.distributed import without_rank_variables
from scripts.bench_common import ROOT, RUN_FAILURES, machine_name, run_dir_for, upsert_row
from scripts.suites import Baseline, SuitesError, load_suites

COLUMNS = [
    "recipe",
    "baseline",
    "memtrain_tokens_per_s",
    "hf_tokens_per_s",
    "ratio",
    "memtrain_target_tokens_per_s",
    "hf_target_tokens_per_s",
    "memtrain_peak_reserved_gib",
    "hf_peak_reserved_gib",
    "memtrain_host_gib",
    "hf_host_gib",
    "memtrain_first_step_s",
    "hf_first_step_s",
    "memtrain_setup",
    "machine",
    "date",
    "command",
]
GiB = 1024**3


def _run(command: list[str], log: Path, timeout: int) -> None:
    """Run one side with its output in `log`; on failure, show the log's tail."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as stream:
        done = subprocess.run(
            command,
            cwd=ROOT,
            timeout=timeout,
            stdout=stream,
            stderr=subprocess.STDOUT,
            env=without_rank_variables(os.environ),
        )
    if done.returncode != 0:
        print(f"{command[1]} exited {done.returncode}; last lines of {log}:", file=sys.stderr)
        print("\n".join(log.read_text(errors="replace").splitlines()[-15:]), file=sys.stderr)


def memtrain_side(recipe: str, overrides: list[str], steps: int, warmup: int, run_dir: Path, timeout: int) -> dict:
    command = [
        sys.executable,
        "-m",
        "memtrain",
        "run",
        recipe,
        *overrides,
        f"train.steps={steps}",
        "train.eval_every=100000",
        "train.save_every=100000",
        "train.log_every=1",
        f"train.output_dir={run_dir}",
        "--no-resume",
        "--no-save",
    ]
    _run(command, run_dir.parent / f"{run_dir.name}.log", timeout)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    start = next(r for r in records if r["kind"] == "run" and r.get("event") == "start")
    train = [r for r in records if r["kind"] == "train"]
    timed = train[warmup:]
    seconds = timed[-1]["time"] - timed[0]["time"]
    # the train records' cumulative counts: real input tokens (padding left out; both sequences of a pair) and the
    # loss's target tokens, as the baselines count theirs
    return {
        "tokens_per_s": (timed[-1]["tokens"] - timed[0]["tokens"]) / seconds,
        "target_tokens_per_s": (timed[-1]["target_tokens"] - timed[0]["target_tokens"]) / seconds,
        "peak_reserved_gib": max(r.get("gpu_peak_reserved_bytes", 0) for r in train) / GiB,
        "host_peak_rss_gib": max(r.get("host_peak_rss_bytes", 0) for r in train) / GiB,
        "first_step_s": train[0]["time"] - start["process_started"],
        "device": start.get("device"),
        "setup": _setup(start, json.loads((run_dir / "recipe.json").read_text())),
    }


def _setup(start: dict, recipe: dict) -> str:
    """What memtrain ran with, 'auto' resolved: micro-batch, checkpointing, allocator, compiled layers (replayed as
    CUDA graphs or not), Liger."""
    checkpointing = describe_checkpointing(Checkpointing.model_validate(recipe["checkpointing"]))
    allocator = "expandable" if recipe["hardware"].get("expandable_segments") else "caching"
    compiled = ", compiled layers" if recipe.get("train", {}).get("compile") is True else ""
    compiled += " as CUDA graphs" if recipe.get("train", {}).get("cuda_graphs") is True else ""
    liger = {"liger": ", liger kernels", "liger_loss": ", liger loss"}.get(recipe.get("model", {}).get("kernels"), "")
    return f"mb {start.get('micro_batch')}, {checkpointing}, {allocator}{compiled}{liger}"


def baseline_side(
    baseline: Baseline, recipe: str, overrides: list[str], steps: int, warmup: int, out: Path, timeout: int
) -> dict:
    """The baseline's script on the same recipe: the numbers it wrote to `out`."""
    command = [
        sys.executable,
        "-m",
        baseline.module,
        recipe,
        *overrides,
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--out",
        str(out),
        *baseline.args,
    ]
    _run(command, out.with_suffix(".log"), timeout)
    return json.loads(out.read_text())


def _global_batch(recipe: str, overrides: list[str]) -> int:
    return load_recipe(ROOT / recipe, overrides, check=False).recipe.batch.global_batch


def prebuild_cpu_adam() -> None:
    """Build DeepSpeed's CPU Adam once before either side runs, so neither side's time to first step
    includes the one-time JIT build (whichever ran first used to pay it, ~45 s on the H200 machine)."""
    done = subprocess.run(
        [sys.executable, "-c", "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        print(
            f"could not prebuild DeepSpeed's CPU Adam (the first offload run will): {done.stderr[-300:]}",
            file=sys.stderr,
        )


def baselines(text: str) -> list[str]:
    """--baseline hf,hf-liger -> ['hf', 'hf-liger']; names benchmarks/suites.yaml does not know are refused."""
    return baseline_names(text, "baselines")


def baseline_names(text: str, what: str, also: tuple[str, ...] = ()) -> list[str]:
    """A comma-separated list of `also` and the baselines of benchmarks/suites.yaml, as an argparse type: anything
    else is refused, naming what is known (`what`: the option's plural, for the message)."""
    try:
        known = [*also, *load_suites().baselines]
    except SuitesError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{what} are {', '.join(known)} (comma-separated), not {text!r}")
    return names


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", action="append", required=True, help="NAME=RECIPE [key=value ...] [:: key=value]")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--baseline", type=baselines, default=["hf"], help="baselines of benchmarks/suites.yaml, e.g. hf,hf-liger"
    )
    parser.add_argument("--runs", type=Path, default=Path("/tmp/memtrain-vs-hf"))
    parser.add_argument("--timeout", type=int, default=600, help="seconds each run (memtrain's, a baseline's) may take")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = arguments()
    args = parser.parse_args(argv)
    registry = load_suites().baselines
    prebuild_cpu_adam()
    baseline_results: dict[tuple[str, ...], dict] = {}
    for case in args.case:
        name, _, spec = case.partition("=")
        shared, _, ours_only = spec.partition("::")
        recipe, *overrides = shlex.split(shared)
        memtrain_overrides = overrides + shlex.split(ours_only)
        if _global_batch(recipe, overrides) != _global_batch(recipe, memtrain_overrides):
            parser.error(f"case {name}: the memtrain-only overrides change the global batch")
        args.runs.mkdir(parents=True, exist_ok=True)
        command = (
            f"python -m scripts.bench_vs_hf --steps {args.steps} --warmup {args.warmup} "
            f"--baseline {','.join(args.baseline)} --case '{' '.join(case.split())}'"
        )  # a case over several lines: one line
        base = {"recipe": name, "machine": machine_name(), "date": dt.date.today().isoformat(), "command": command}
        ours, ours_error = None, None
        try:
            ours = memtrain_side(
                recipe, memtrain_overrides, args.steps, args.warmup, run_dir_for(args.runs, name), args.timeout
            )
        except RUN_FAILURES as error:
            ours_error = error
        for baseline in args.baseline:
            row = dict(base, baseline=baseline)
            try:
                if ours is None:
                    raise ours_error
                row.update(
                    memtrain_tokens_per_s=f"{ours['tokens_per_s']:.0f}",
                    memtrain_peak_reserved_gib=f"{ours['peak_reserved_gib']:.2f}",
                    memtrain_host_gib=f"{ours['host_peak_rss_gib']:.1f}",
                    memtrain_first_step_s=f"{ours['first_step_s']:.0f}",
                    memtrain_setup=ours["setup"],
                    memtrain_target_tokens_per_s=f"{ours['target_tokens_per_s']:.0f}",
                )
                key = (baseline, recipe, *overrides)
                if key not in baseline_results:
                    baseline_results[key] = baseline_side(
                        registry[baseline],
                        recipe,
                        overrides,
                        args.steps,
                        args.warmup,
                        args.runs / f"{name}.{baseline}.json",
                        args.timeout,
                    )
                theirs = baseline_results[key]
                row.update(
                    hf_tokens_per_s=f"{theirs['tokens_per_s']:.0f}",
                    ratio=f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}",
                    hf_peak_reserved_gib=f"{theirs['peak_reserved_gib']:.2f}",
                    hf_host_gib=f"{theirs['host_peak_rss_gib']:.1f}",
                    hf_first_step_s=f"{theirs['time_to_first_step_s']:.0f}",
                    hf_target_tokens_per_s=f"{theirs['target_tokens_per_s']:.0f}",
                )
            except RUN_FAILURES as error:  # a side that did not finish is a row that says so
                side = "memtrain" if "memtrain_tokens_per_s" not in row else baseline
                log = run_dir_for(args.runs, name) if side == "memtrain" else args.runs / f"{name}.{baseline}"
                log = log.parent / f"{log.name}.log"
                text = log.read_text(errors="replace") if log.exists() else ""
                row["ratio"] = (
                    f"{side} ran out of GPU memory" if "OutOfMemoryError" in text else f"failed: {type(error).__name__}"
                )
            print(json.dumps(row), flush=True)
            upsert_row(
                args.out,
                row,
                COLUMNS,
                "memtrain vs Hugging Face Trainer + DeepSpeed",
                keys=("recipe", "baseline"),
                defaults={"baseline": "hf"},
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
