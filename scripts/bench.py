"""Run a benchmark suite of benchmarks/suites.yaml: its cases, each through the script that measures its kind.

    python -m scripts.bench --list                          # the suites
    python -m scripts.bench lora-vs-hf --list               # a suite's cases
    python -m scripts.bench lora-vs-hf --dry-run            # the commands it would run
    python -m scripts.bench lora-vs-hf --out $OUT           # run it; the tables land in $OUT
    python -m scripts.bench levers --only 7b-lora-zero2     # one case (comma-separated: several)

Each case appends its rows to its table (vs-hf: vs_hf.csv, run: runs.csv, startup: startup.csv, plan-accuracy:
plan_accuracy.csv, longest: long_context.csv; each row with its command, machine and date) and rewrites the
table's Markdown view. --out defaults to benchmarks/, the committed tables; another folder starts from a copy of
each committed table, so what it holds at the end is the whole table to commit. Consecutive vs-hf cases that
differ only in memtrain's levers share one invocation, which runs each baseline once for all of them. --budget-s
bounds the whole call: a case that no longer fits is skipped and the command that runs the rest is printed, so a
matrix larger than one call on the GPU machine goes on in the next.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from scripts.bench_common import ROOT
from scripts.suites import (
    Longest,
    MemtrainRun,
    PlanAccuracy,
    Startup,
    Suite,
    Suites,
    SuitesError,
    VsBaselines,
    load_suites,
)

COMMITTED = ROOT / "benchmarks"
TABLES = {
    "vs-hf": "vs_hf.csv",
    "run": "runs.csv",
    "startup": "startup.csv",
    "plan-accuracy": "plan_accuracy.csv",
    "longest": "long_context.csv",
}
RUNS_TITLE = "memtrain run on the GPU machine (24 GiB cap)"
# A benchmark's own steps: no evaluation or checkpoint inside the measured steps
QUIET = ("train.eval_every=100000", "train.save_every=100000")
HOLDER_READY_S = 120  # a fresh machine takes a while to make its first CUDA context


@dataclass
class Invocation:
    """One run of a measuring script for one or more cases of a suite."""

    kind: str
    cases: list = field(default_factory=list)

    @property
    def budget_s(self) -> int:
        return sum(case.budget_s for case in self.cases)

    @property
    def names(self) -> list[str]:
        return [case.name for case in self.cases]


def invocations(cases: list) -> list[Invocation]:
    """The cases in order, consecutive ones that share an invocation together."""
    out: list[Invocation] = []
    for case in cases:
        shared = _shared(case)
        if out and shared is not None and _shared(out[-1].cases[-1]) == shared and out[-1].kind == case.kind:
            out[-1].cases.append(case)
        else:
            out.append(Invocation(case.kind, [case]))
    return out


def _shared(case) -> tuple | None:
    """What cases must have in common to run in one invocation, or None: the case runs alone. vs-hf cases that
    differ only in memtrain's own levers share an invocation, which runs each baseline once for all of them."""
    if isinstance(case, VsBaselines):
        return (case.recipe, case.overrides, case.steps, case.warmup_steps, case.baselines, case.timeout_s)
    return None


def command(invocation: Invocation, out: Path) -> list[str]:
    """The measuring script's command line for these cases, writing into `out`."""
    first = invocation.cases[0]
    table = str(out / TABLES[invocation.kind])
    if isinstance(first, VsBaselines):
        argv = ["scripts.bench_vs_hf", "--out", table, "--steps", str(first.steps), "--warmup"]
        argv += [str(first.warmup_steps), "--baseline", ",".join(first.baselines), "--timeout", str(first.timeout_s)]
        for case in invocation.cases:
            spec = shlex.join([case.recipe, *case.overrides])
            if case.memtrain_overrides:
                spec += " :: " + shlex.join(case.memtrain_overrides)
            argv += ["--case", f"{case.row}={spec}"]
    elif isinstance(first, MemtrainRun):
        argv = ["scripts.bench_run", "--out", table, "--title", RUNS_TITLE, "--timeout", str(first.timeout_s)]
        argv += ["--warmup-steps", str(first.warmup_steps)]
        argv += ["--resume-at", str(first.resume_at)] if first.resume_at else []
        for case in invocation.cases:
            spec = shlex.join([case.recipe, *case.overrides, f"train.steps={case.steps}", *QUIET])
            argv += ["--case", f"{case.row}={spec}"]
    elif isinstance(first, Startup):
        spec = shlex.join([first.recipe, *first.overrides])
        argv = ["scripts.bench_startup", "--out", table, "--machine-state", first.machine_state]
        argv += ["--steps", str(first.steps), "--timeout", str(first.timeout_s), "--name", first.row]
        argv += ["--recipe", spec] * first.runs + (["--prepare"] if first.prepare else [])
    elif isinstance(first, PlanAccuracy):
        argv = ["scripts.plan_accuracy", "--out", table, "--timeout", str(first.timeout_s)]
        argv += ["--parallel", str(first.parallel), "--host-budget-gib", f"{first.host_budget_gib:g}"]
        argv += ["--group", first.group] + (["--only", ",".join(first.only)] if first.only else [])
        argv += ["--calibrate"] if first.calibrate else []
    elif isinstance(first, Longest):
        argv = ["scripts.bench_long_context", "--out", table, "--name", first.model]
        argv += ["--recipe", shlex.join([first.recipe, *first.overrides]), "--methods", ",".join(first.methods)]
        argv += ["--lengths", ",".join(map(str, first.lengths)), "--steps", str(first.steps)]
        argv += ["--warmup", str(first.warmup_steps), "--timeout", str(first.timeout_s)]
    else:
        raise TypeError(f"no command for a {type(first).__name__} case")
    return [sys.executable, "-m", *argv]


def shown(argv: list[str]) -> str:
    """A command as a person types it, from the project root."""
    argv = ["python", *argv[1:]] if argv[0] == sys.executable else argv
    return shlex.join(arg.removeprefix(f"{ROOT}/") for arg in argv)


def child_environment() -> dict[str, str]:
    """The measuring scripts' environment. Python writes its bytecode, to a folder of its own: the GPU machine's
    image keeps none beside PyTorch and transformers, so without it every start compiled ~5,000 modules again
    (~11 s of each start), which pip's install-time compile spares a user's machine."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.setdefault("PYTHONPYCACHEPREFIX", "/tmp/pycache")
    return env


def start_tables(invocation: Invocation, out: Path) -> None:
    """Start `out`'s table from the committed one, so the rows of this call are added to the whole table."""
    table = out / TABLES[invocation.kind]
    committed = COMMITTED / TABLES[invocation.kind]
    if out.resolve() != COMMITTED.resolve() and not table.exists() and committed.exists():
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(committed, table)


def run_invocation(invocation: Invocation, argv: list[str], out: Path, limit_s: int) -> int:
    """Run the script within `limit_s`; a held run beside the GPU memory holder and the host memory sampler."""
    env = child_environment()
    if isinstance(invocation.cases[0], MemtrainRun) and invocation.cases[0].hold_gpu:
        with held_gpu(out, invocation.cases[0].name, env):
            return run_limited(argv, env, limit_s)
    return run_limited(argv, env, limit_s)


def run_limited(argv: list[str], env: dict, limit_s: int) -> int:
    """The command in its own process group, stopped whole (its runs too) once `limit_s` has passed."""
    process = subprocess.Popen(argv, cwd=ROOT, env=env, start_new_session=True)
    try:
        return process.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        print(f"== stopped after {limit_s} s, the case's budget", flush=True)
        os.killpg(process.pid, signal.SIGTERM)
        try:
            return process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            return process.wait()
    except KeyboardInterrupt:
        os.killpg(process.pid, signal.SIGTERM)
        raise


class held_gpu:
    """scripts/hold_gpu_memory.py (the card physically 24 GiB) and scripts/sample_host_memory.py (machine-wide host
    memory into host_memory/host-NAME.json under the tables' folder) beside the runs inside the `with`, both stopped
    after them."""

    def __init__(self, out: Path, name: str, env: dict):
        self.out, self.name, self.env = out / "host_memory", name, env
        self.holder: subprocess.Popen | None = None
        self.sampler: subprocess.Popen | None = None

    def __enter__(self) -> held_gpu:
        self.out.mkdir(parents=True, exist_ok=True)
        log = self.out / f"hold-{self.name}.txt"
        with log.open("w") as stream:
            self.holder = subprocess.Popen(
                [sys.executable, "-m", "scripts.hold_gpu_memory"], cwd=ROOT, env=self.env, stdout=stream, stderr=stream
            )
        deadline = time.monotonic() + HOLDER_READY_S
        while "holding" not in log.read_text() and self.holder.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        print(log.read_text().strip(), flush=True)
        if "holding" not in log.read_text():
            self.__exit__()
            raise RuntimeError(f"the GPU memory holder did not start; its output is in {log}")
        self.sampler = subprocess.Popen(
            [sys.executable, "-m", "scripts.sample_host_memory", str(self.out / f"host-{self.name}.json")],
            cwd=ROOT,
            env=self.env,
        )
        return self

    def __exit__(self, *_) -> None:
        for process in (self.sampler, self.holder):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(timeout=30)


def select(suites: Suites, suite_name: str, only: str) -> list:
    """The suite's cases, or those --only names (comma-separated), in the suite's order."""
    suite = suites.suites[suite_name]
    names = [name for name in only.split(",") if name]
    unknown = [name for name in names if name not in {case.name for case in suite.cases}]
    if unknown:
        raise SuitesError(
            f"suite {suite_name} has no case {', '.join(unknown)}; its cases are "
            + ", ".join(case.name for case in suite.cases)
        )
    return [case for case in suite.cases if not names or case.name in names]


def listing(suites: Suites, suite_name: str | None) -> Iterator[str]:
    if suite_name is None:
        for name, suite in suites.suites.items():
            budget_s = sum(case.budget_s for case in suite.cases)
            cases = f"{len(suite.cases)} case" + ("s" if len(suite.cases) > 1 else "")
            yield f"{name:18s} {cases:8s} ~{-(-budget_s // 60):3d} min  {suite.about}"
        return
    suite: Suite = suites.suites[suite_name]
    yield f"{suite_name}: {suite.about}"
    for case in suite.cases:
        what = getattr(case, "recipe", None) or f"plan_accuracy group {case.group}"
        yield f"  {case.name:34s} {case.kind:13s} {case.budget_s:4d} s  {what}" + (
            f"  ({case.about})" if case.about else ""
        )


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("suite", nargs="?", help="a suite of benchmarks/suites.yaml (--list names them)")
    parser.add_argument("--only", default="", help="these cases of the suite (comma-separated names)")
    parser.add_argument("--out", type=Path, default=COMMITTED, help="folder of the tables (default: benchmarks/)")
    parser.add_argument("--list", action="store_true", help="list the suites, or the suite's cases")
    parser.add_argument("--dry-run", action="store_true", help="print the commands without running them")
    parser.add_argument("--budget-s", type=int, default=0, help="seconds this call may take (0: no limit)")
    parser.add_argument("--suites", type=Path, default=None, help=argparse.SUPPRESS)  # another file, for tests
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = arguments()
    args = parser.parse_args(argv)
    try:
        suites = load_suites(args.suites) if args.suites else load_suites()
        if args.suite is not None and args.suite not in suites.suites:
            raise SuitesError(f"no suite {args.suite}; the suites are {', '.join(suites.suites)}")
        if args.list:
            print("\n".join(listing(suites, args.suite)))
            return 0
        if args.suite is None:
            parser.error("name a suite (--list names them)")
        cases = select(suites, args.suite, args.only)
    except SuitesError as error:
        print(error, file=sys.stderr)
        return 2
    started = time.monotonic()
    failed, skipped = [], []
    for invocation in invocations(cases):
        argv = command(invocation, args.out)
        if args.dry_run:
            print(f"# {', '.join(invocation.names)}: up to {invocation.budget_s} s")
            print(shown(argv))
            continue
        left_s = args.budget_s - int(time.monotonic() - started) if args.budget_s else invocation.budget_s
        if left_s < invocation.budget_s:
            skipped += invocation.names
            continue
        print(f"== {', '.join(invocation.names)} (up to {invocation.budget_s} s) at {time.monotonic() - started:.0f} s")
        print(shown(argv), flush=True)
        start_tables(invocation, args.out)
        try:
            code = run_invocation(invocation, argv, args.out, invocation.budget_s)
        except RuntimeError as error:  # the GPU memory holder did not start: the held runs would measure nothing
            print(f"== {error}", flush=True)
            code = 1
        if code != 0:
            failed += invocation.names
    if skipped:
        rest = shlex.join(["python", "-m", "scripts.bench", args.suite, "--only", ",".join(skipped)])
        print(f"== skipped (the budget left was too short): {', '.join(skipped)}\n   the rest: {rest}")
    if failed:
        print(f"== did not finish cleanly: {', '.join(failed)} (the tables say which rows)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
