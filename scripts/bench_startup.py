"""Command to first optimizer step, per start-up phase: `memtrain run RECIPE` for a few steps per recipe.

Each run's `startup` record (metrics.jsonl; memtrain.monitor.startup) gives the seconds of every phase from
the process's start to the end of the first optimizer step; the phases sum to first_step_s. One row per
recipe in benchmarks/startup.csv (rows keyed by recipe and machine state), and its Markdown view.

    python -m scripts.bench_startup --machine-state warm --out benchmarks/startup.csv \\
        --recipe recipes/llama2-7b-lora-24gb.yaml --recipe "recipes/tinyllama-1.1b-full-offload-24gb.yaml"

--machine-state fresh starts the invocation with empty compiled-op caches (TORCH_EXTENSIONS_DIR for DeepSpeed's
CPU Adam, TRITON_CACHE_DIR for Triton kernels such as Liger's, TORCHINDUCTOR_CACHE_DIR for compiled layers' graphs)
kept under --runs for the whole invocation:
the first recipe runs on a fresh machine and is labelled `fresh`, the later ones find what it built and
are labelled `warm`. --machine-state warm uses the caches as they are and labels every row `warm`.
The token cache (MEMTRAIN_CACHE) is emptied with them.
--prepare runs `memtrain prepare` on the first recipe before it (the one-time work done ahead, as in a
container's set-up) and gives its seconds in the `prepare_s` column, outside first_step_s.
A recipe may carry overrides after it ("RECIPE key=value ...").
--jsonl-mb N writes N MB of JSONL text (the bundled plays in ~2 KB documents, repeated; under --runs, kept between
invocations) and puts its path where a recipe spec says {jsonl}: start-up with data of the size users bring.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from memtrain.monitor.startup import PHASES
from memtrain.train.runtime.distributed import without_rank_variables
from scripts.bench_common import ROOT, machine_name, upsert_row

COLUMNS = ["recipe", "machine_state", "first_step_s", "prepare_s", *PHASES, "machine", "date", "command"]


def run_once(spec: str, steps: int, run_dir: Path, env: dict, timeout: int) -> dict:
    """`memtrain run` for `steps` optimizer steps; the run's startup record."""
    recipe, *overrides = shlex.split(spec)
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "memtrain",
        "run",
        recipe,
        *overrides,
        f"train.output_dir={run_dir}",
        "train.eval_every=100000",
        "train.save_every=100000",
        "train.log_every=1",
        "train.eval_batches=1",
        "--max-steps",
        str(steps),
        "--no-resume",
        "--no-save",
    ]
    log = run_dir.parent / f"{run_dir.name}.log"
    with log.open("w") as stream:
        done = subprocess.run(command, cwd=ROOT, env=env, timeout=timeout, stdout=stream, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"memtrain run {spec} exited {done.returncode}; last lines of {log}:\n{tail}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return next(r for r in records if r["kind"] == "startup")


def prepare(spec: str, env: dict, timeout: int) -> float:
    """`memtrain prepare RECIPE`: its wall-clock seconds."""
    recipe, *overrides = shlex.split(spec)
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "memtrain", "prepare", recipe, *overrides],
        cwd=ROOT,
        env=env,
        timeout=timeout,
        check=True,
        stdout=sys.stderr,
    )
    return time.perf_counter() - started


def make_jsonl(path: Path, megabytes: int) -> Path:
    """`megabytes` MB of {"text": ...} lines cut from the bundled plays, repeated; made once per size."""
    if path.exists() and path.stat().st_size >= megabytes << 20:
        return path
    corpus = gzip.decompress((ROOT / "memtrain/assets/corpus/shakespeare/train.txt.gz").read_bytes()).decode()
    lines = [json.dumps({"text": corpus[i : i + 2048]}) + "\n" for i in range(0, len(corpus), 2048)]
    block = "".join(lines).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        for _ in range(-(-(megabytes << 20) // len(block))):
            handle.write(block)
    return path


def row_of(name: str, state: str, startup: dict, command: str, prepare_s: float | None = None) -> dict:
    phases = startup["phases_s"]
    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        raise ValueError(f"phases {unknown} have no column: add them to memtrain.monitor.startup.PHASES")
    return {
        "recipe": name,
        "machine_state": state,
        "first_step_s": f"{startup['first_step_s']:.1f}",
        "prepare_s": "" if prepare_s is None else f"{prepare_s:.1f}",
        **{phase: f"{phases[phase]:.1f}" if phase in phases else "" for phase in PHASES},
        "machine": machine_name(),
        "date": dt.date.today().isoformat(),
        "command": command,
    }


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", action="append", required=True, help="RECIPE [key=value ...]")
    parser.add_argument("--machine-state", choices=("warm", "fresh"), required=True)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "startup.csv")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per run (the first is the one timed)")
    parser.add_argument("--runs", type=Path, default=Path("/tmp/memtrain-startup"))
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--label", default="", help="added to each row's recipe name in parentheses (a setting)")
    parser.add_argument("--name", default="", help="the rows' name in place of the recipe's file name and overrides")
    parser.add_argument("--prepare", action="store_true", help="run `memtrain prepare` on the first recipe before it")
    parser.add_argument("--jsonl-mb", type=int, default=0, help="generate this many MB of JSONL text for {jsonl}")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = arguments()
    args = parser.parse_args(argv)
    jsonl = make_jsonl(args.runs / f"plays-{args.jsonl_mb}mb.jsonl", args.jsonl_mb) if args.jsonl_mb else None
    env = without_rank_variables(os.environ)  # each run starts its own process group
    if args.machine_state == "fresh":
        caches = args.runs / "fresh-caches"
        shutil.rmtree(caches, ignore_errors=True)
        env.update(
            TORCH_EXTENSIONS_DIR=str(caches / "torch_extensions"),
            TRITON_CACHE_DIR=str(caches / "triton"),
            TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
            MEMTRAIN_CACHE=str(caches / "tokens"),
        )
    prepare_s = prepare(args.recipe[0], env, args.timeout) if args.prepare else None
    failed = 0
    for index, spec in enumerate(args.recipe):
        state = "fresh" if args.machine_state == "fresh" and index == 0 else "warm"
        name = args.name or " ".join(Path(part).stem if i == 0 else part for i, part in enumerate(shlex.split(spec)))
        name += f" ({args.label})" if args.label else ""
        command = (
            f"python -m scripts.bench_startup --machine-state {args.machine_state} --steps {args.steps} "
            f"--recipe '{spec}'"
            + (f" --label '{args.label}'" if args.label else "")
            + (f" --name {shlex.quote(args.name)}" if args.name else "")
            + (" --prepare" if args.prepare and index == 0 else "")
            + (f" --jsonl-mb {args.jsonl_mb}" if jsonl else "")
        )
        if "{jsonl}" in spec and jsonl is None:
            parser.error(f"{spec!r} names {{jsonl}}: give --jsonl-mb")
        try:
            startup = run_once(
                spec.replace("{jsonl}", str(jsonl)), args.steps, args.runs / f"run-{index}", env, args.timeout
            )
        except (RuntimeError, subprocess.TimeoutExpired, StopIteration, FileNotFoundError) as error:
            print(f"{name}: no startup record ({type(error).__name__}: {error})", file=sys.stderr, flush=True)
            failed += 1
            continue  # the next recipe still runs
        row = row_of(name, state, startup, command, prepare_s if index == 0 else None)
        print(json.dumps(row), flush=True)
        upsert_row(
            args.out,
            row,
            COLUMNS,
            "memtrain start-up: command to first optimizer step, per phase (s)",
            keys=("recipe", "machine_state"),
            defaults={"prepare_s": ""},
        )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
