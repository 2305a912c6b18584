"""Entry point of each process that torchrun starts: `python -m memtrain.train.worker RUN_FILE [flags]`.

RUN_FILE is the run the launcher resolved (run.json in the run directory); the flags are the
launcher's RunOptions (RunOptions.to_flags). Test hooks are read from this process's environment.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from memtrain.errors import UserError
from memtrain.train.hooks import Hooks
from memtrain.train.launch import train_here
from memtrain.train.run import ResolvedRun, RunOptions
from memtrain.train.signals import die_with_parent, exit_code, signum_of, stop_on_signals


def parse_options(argv: list[str]) -> tuple[Path, RunOptions]:
    parser = argparse.ArgumentParser(prog="memtrain.train.worker")
    parser.add_argument("run_file", type=Path)
    RunOptions.add_flags(parser)
    args = parser.parse_args(argv)
    return args.run_file, RunOptions.from_flags(args)


def main(argv: list[str]) -> int:
    die_with_parent(signal.SIGKILL)  # torchrun gone: nothing coordinates the ranks any more
    run_file, options = parse_options(argv)
    try:
        with stop_on_signals():
            result = train_here(ResolvedRun.from_json(run_file.read_text()), options, Hooks.from_env())
    except UserError as error:
        for problem in error.problems:
            print(f"✗ {problem.format()}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt as stop:  # during start-up, or a second Ctrl-C: nothing saved
        return exit_code(signum_of(stop))
    if os.environ.get("RANK", "0") == "0":  # one line per run, not one per process
        print(f"{'✓' if result.finished else '■'} {result.summary()}", file=sys.stderr)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
