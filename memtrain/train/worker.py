"""Entry point of each process that torchrun starts: `python -m memtrain.train.worker RUN_FILE [flags]`.

RUN_FILE is the run the launcher resolved (run.json in the run directory); the flags are the
launcher's RunOptions (RunOptions.to_flags). Test hooks are read from this process's environment.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from memtrain.errors import UserError
from memtrain.train.runtime.peers import lost_line, roll_call
from memtrain.train.runtime.result import EXIT_PEER_LOST, EXIT_RESTART
from memtrain.train.runtime.signals import (
    die_with_parent,
    exit_code,
    mark_ending,
    marked_ending,
    not_saved_line,
    received_stop,
    say_once,
    signum_of,
    stop_asked,
    stop_on_signals,
)
from memtrain.train.state.restart_note import RestartEveryProcess

if TYPE_CHECKING:  # for the reader: main imports them under its signal handlers
    from memtrain.train.resolve import RunOptions


NON_HOST_EXIT_DELAY_S = 2.0  # torchrun's agents notice their workers' exit within 0.1 s (its monitor interval)


def parse_options(argv: list[str]) -> tuple[Path, RunOptions]:
    from memtrain.train.resolve import RunOptions  # noqa: PLC0415 — torch and the rest: see main

    parser = argparse.ArgumentParser(prog="memtrain.train.worker")
    parser.add_argument("run_file", type=Path)
    RunOptions.add_flags(parser)
    args = parser.parse_args(argv)
    return args.run_file, RunOptions.from_flags(args)


def main(argv: list[str]) -> int:
    die_with_parent(signal.SIGKILL)  # torchrun gone: nothing coordinates the ranks any more
    try:
        with stop_on_signals():
            # torch, transformers and DeepSpeed import for seconds: under the handlers, a Ctrl-C then is one line
            # (imported at the top, a Ctrl-C there is a KeyboardInterrupt traceback from each worker)
            from memtrain.monitor.startup import CLOCK_ENV, StartupClock  # noqa: PLC0415
            from memtrain.train.launch import train_here  # noqa: PLC0415
            from memtrain.train.resolve import ResolvedRun  # noqa: PLC0415
            from memtrain.train.step.hooks import Hooks  # noqa: PLC0415

            clock = StartupClock.from_env(os.environ.get(CLOCK_ENV))  # from the command's start, as one process's
            run_file, options = parse_options(argv)
            run = ResolvedRun.from_json(run_file.read_text())
            result = train_here(run, options, Hooks.from_env(), clock=clock)
        if run.recipe.hardware.nodes > 1:
            leave_after_node_0()
    except RestartEveryProcess as restart:  # this process ran out of memory in backward; its note is written
        mark_ending(EXIT_RESTART)  # before it leaves: the others' collectives break then
        if say_once([restart.line]):
            print(f"■ {restart.line}", file=sys.stderr)
        return EXIT_RESTART
    except UserError as error:
        mark_ending(error.exit_code)
        lines = [f"✗ {problem.format()}" for problem in error.problems]
        if lines and say_once(lines):  # every rank meets a full disk: one line per node, not one per process
            print("\n".join(lines), file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt as stop:  # during start-up, or a second Ctrl-C: nothing saved
        if (ending := marked_ending()) is not None:  # torchrun stopped this process: another ended on purpose
            return ending
        return stopped_unsaved(signum_of(stop))
    except RuntimeError as error:  # a collective broke: after a stop, a peer that was still starting has left
        if (ending := marked_ending()) is not None:  # the peer ended on purpose and said why (signals.mark_ending)
            return ending
        stop = received_stop()
        if stop is not None and stop_asked():
            return stopped_unsaved(stop)
        from memtrain.train.runtime.distributed import peer_gone  # noqa: PLC0415 — torch: imported by main already

        if not peer_gone(error):
            raise
        if stop is not None:  # torchrun's agent stopped this process because a worker of this node died: it says so
            return EXIT_PEER_LOST
        return peer_lost()
    say_for_the_run(f"{'✓' if result.finished else '■'} {result.summary()}")
    return result.exit_code


def peer_lost() -> int:
    """A collective broke and no peer said why: it died without a word. The ranks that miss the roll call are named,
    once per node; the others of this node end quietly with the same code."""
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    missing = roll_call(rank, world_size)
    if (ending := marked_ending()) is not None:  # a peer of this node said it meanwhile
        return ending
    mark_ending(EXIT_PEER_LOST)
    line = f"✗ {lost_line(missing, int(os.environ.get('LOCAL_WORLD_SIZE', '1')), world_size)}"
    if say_once([line]):
        print(line, file=sys.stderr)
    return EXIT_PEER_LOST


def stopped_unsaved(signum: int) -> int:
    """A stop before this run saved: one line for the run (from rank 0), the shell's code for the signal."""
    say_for_the_run(f"■ {not_saved_line(signum)}")
    return exit_code(signum)


def say_for_the_run(line: str) -> None:
    """Rank 0 says how the run ended, marked as said (the launcher says it when no worker could)."""
    if os.environ.get("RANK", "0") == "0" and say_once([line]):
        print(line, file=sys.stderr)


def leave_after_node_0() -> None:
    """After a multi-node run: every rank meets once more (rank 0 may still have been exporting), then the workers
    of the other nodes wait a moment before they exit.

    torchrun's agents meet in an exit barrier on the store that node 0's agent hosts. When node 0 arrives there last,
    its agent sets the barrier's key and exits at once, closing the store, while another node's agent may not have
    started waiting for the key yet: that agent then logs a DistNetworkError traceback although the run succeeded
    (seen on two CPU "nodes" of one machine under load). With node 0 arriving first, it waits for the others and
    leaves last."""
    from memtrain.train.runtime.distributed import barrier  # noqa: PLC0415 — imported by main already

    barrier()
    if int(os.environ.get("GROUP_RANK", "0")) > 0:
        time.sleep(NON_HOST_EXIT_DELAY_S)


def leave(code: int) -> None:
    """Exit without Python's and C++'s teardown. The process group is never destroyed, and when a peer has exited
    first a store or gloo thread's destructor can abort the process ("terminate called without an active
    exception", SIGABRT: seen once as exit 134 instead of 2 when two nodes disagreed on the recipe). Everything the
    run owns was closed before `main` returned; only the output is flushed here."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    leave(main(sys.argv[1:]))
