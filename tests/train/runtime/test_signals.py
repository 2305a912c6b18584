"""torchrun's own log lines around memtrain's (a broken exit barrier after a finished run is not a traceback, its
lines about workers' ends are left out), and stops that come at awkward moments: while a worker imports, inside a
finaliser, or to a run that finishes anyway."""

from __future__ import annotations

import io
import logging

import pytest

from memtrain.train.runtime.signals import EXIT_BARRIER_LOGGER, QuietExitBarrier
from tests.test_main import INTERRUPT_ONCE_TORCH_LOADS


def test_a_broken_exit_barrier_after_a_finished_run_is_one_warning_line_not_a_traceback():
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.agent.server import api  # the logger torchrun's agent writes with

    assert api.logger.name == EXIT_BARRIER_LOGGER
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    quiet = QuietExitBarrier()
    api.logger.addHandler(handler)
    api.logger.addFilter(quiet)
    try:
        try:  # what api.SimpleElasticAgent._exit_barrier logs when node 0's agent has closed the store
            raise DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed.")
        except DistNetworkError:
            api.logger.exception("Error waiting on exit barrier. Elapsed: %s seconds", 0.3)
        api.logger.error("Some other error %s", 7)  # other records pass unchanged
    finally:
        api.logger.removeFilter(quiet)
        api.logger.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert lines == [
        "WARNING the nodes' exit barrier broke (node 0 left first); every worker had finished, so nothing is lost",
        "ERROR Some other error 7",
    ], lines


def test_a_launcher_that_forwarded_a_signal_to_a_run_that_finished_anyway_exits_0():
    """A Ctrl-C forwarded to a run that then finished (its final model written) exited 130."""
    import os
    import signal
    import sys
    import threading
    import time

    from memtrain.train.runtime.signals import run_forwarding_signals

    finishes = [
        sys.executable,
        "-c",
        "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(3)",
    ]
    threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    started = time.time()
    assert run_forwarding_signals(finishes, dict(os.environ)) == 0
    assert time.time() - started > 2  # the signal came while it ran
    interrupted = [sys.executable, "-c", "import time; time.sleep(3)"]  # Python's default: KeyboardInterrupt, 1
    threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    assert run_forwarding_signals(interrupted, dict(os.environ)) == 130


SWALLOWED_STOP = """
import os, signal, sys, time
import memtrain.train.step.hooks as hooks

class Finaliser:
    def __del__(self):  # Ctrl-C lands while a finaliser runs: the handler's exception is printed and lost
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)

def start_slowly(self):
    Finaliser()  # made and collected at once, during start-up

hooks.Hooks.wait_slow_start = start_slowly
sys.argv = ["memtrain", "run", sys.argv[1], "model.preset=micro", "train.steps=20", "schedule.warmup_steps=1",
            "train.save_every=100", "train.eval_every=100", "train.output_dir=" + sys.argv[2]]
from memtrain.__main__ import main
main()
"""


@pytest.mark.slow
def test_a_stop_whose_exception_a_finaliser_swallowed_still_stops_the_run(tmp_path):
    """The start-up handler's Stopped, raised inside a regex finaliser, became 'Exception ignored in' and
    the run trained to its end. The loop now finds the stop noted and stops after its first step, saved."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from tests.train.test_run import clean_env

    recipe = Path(__file__).resolve().parents[3] / "recipes" / "quickstart.yaml"
    done = subprocess.run(
        [sys.executable, "-c", SWALLOWED_STOP, str(recipe), str(tmp_path / "run")],
        text=True,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=600,
    )
    assert done.returncode == 130, done.stdout[-3000:]
    steps = [
        json.loads(line)["step"]
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        if json.loads(line).get("kind") == "train"
    ]
    assert steps == [1], done.stdout[-3000:]
    assert "interrupted at step 1" in done.stdout


INTERRUPT_WORKER_IMPORTS = (
    INTERRUPT_ONCE_TORCH_LOADS
    + """
sys.argv = ["memtrain.train.worker", "no-such-run.json"]
runpy.run_module("memtrain.train.worker", run_name="__main__")
"""
)


def test_ctrl_c_while_a_worker_imports_is_one_line_not_a_traceback():
    """The worker imported torch, transformers and DeepSpeed before its handlers were set, so a Ctrl-C
    then was a KeyboardInterrupt traceback from each worker."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", INTERRUPT_WORKER_IMPORTS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 130, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "stopped by Ctrl-C before the run could save" in done.stderr


def test_torchruns_lines_about_its_workers_ends_are_left_out_and_others_kept():
    from torch.distributed.elastic.agent.server import api as agent
    from torch.distributed.elastic.multiprocessing import api as workers

    from memtrain.train.runtime.signals import WORKERS_LOGGER, QuietWorkerEnds

    assert workers.logger.name == WORKERS_LOGGER
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    quiet = QuietWorkerEnds()
    for logger in (agent.logger, workers.logger):
        logger.addHandler(handler)
        logger.addFilter(quiet)
    try:
        agent.logger.warning("Received %s death signal, shutting down workers", 2)
        workers.logger.warning("Sending process %s closing signal %s", 4242, "SIGINT")
        workers.logger.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 2, 0, 4242, "python")
        workers.logger.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", -11, 0, 4242, "python")
        workers.logger.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 1, 0, 4242, "python")
        workers.logger.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 69, 0, 4242, "python")
    finally:
        for logger in (agent.logger, workers.logger):
            logger.removeFilter(quiet)
            logger.removeHandler(handler)
    # a worker killed by a signal (-11) is named by memtrain's own line (torchrun_main), as one that lost a peer (69)
    assert out.getvalue().splitlines() == ["failed (exitcode: 1) local_rank: 0 (pid: 4242) of binary: python"]


def test_ctrl_c_as_torchrun_starts_ends_with_130_and_no_traceback():
    """A Ctrl-C the launcher forwards while torchrun (or a worker) is still being imported by runpy, before any of
    memtrain's handlers is set, ended in a KeyboardInterrupt traceback from <frozen runpy> and no line at all
    (seen on the CPU with the signal 8 s into a two-process start). python_command ends such a start with 130."""
    import subprocess

    from memtrain.train.runtime.signals import python_command
    from tests.test_main import INTERRUPT_ONCE_TORCH_LOADS

    executable, unbuffered, flag, code = python_command("memtrain.train.runtime.signals")
    done = subprocess.run(
        [executable, unbuffered, flag, INTERRUPT_ONCE_TORCH_LOADS + code, "--nproc_per_node=1", "--no-python", "true"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 130, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_the_launcher_says_the_stop_when_no_worker_could(tmp_path):
    import signal

    from memtrain.train.runtime.signals import say_once, unsaid_stop_line

    said = tmp_path / "said"
    said.mkdir()
    assert unsaid_stop_line(said, 130) == (
        "■ stopped by Ctrl-C before the run could save; the run directory keeps its "
        "last complete checkpoint, if any — run the same command to resume"
    )
    assert unsaid_stop_line(said, 128 + signal.SIGTERM).startswith("■ stopped by SIGTERM before the run could save")
    assert [unsaid_stop_line(said, code) for code in (0, 1, 2, 75)] == [None] * 4
    import os

    os.environ["MEMTRAIN_SAID_DIR"] = str(said)
    try:
        assert say_once(["■ interrupted at step 3; checkpoint in runs/x/checkpoints"])  # rank 0 said how it ended
    finally:
        del os.environ["MEMTRAIN_SAID_DIR"]
    assert unsaid_stop_line(said, 130) is None


def test_ranks_that_measure_the_same_full_disk_apart_say_it_once(tmp_path, monkeypatch):
    """Each rank reads the free space when its own save fails: the same problem in lines whose numbers differ."""
    from memtrain.train.runtime.signals import SAID_DIR_ENV, say_once

    monkeypatch.setenv(SAID_DIR_ENV, str(tmp_path))
    full = "✗ train.output_dir: no space left on / while saving the checkpoint of step 4 (needs ~9.9 MB, {} GB free)"
    assert say_once([full.format(77)])
    assert not say_once([full.format(78)])  # another rank, a moment later
    assert say_once(["✗ data.train: no file at data/train.jsonl"])  # another problem is said
