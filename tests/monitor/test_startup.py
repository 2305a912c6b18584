"""The start-up clock: each mark gives the time since the previous one to its phase, so they sum to the total; and
the note for a Python that compiles the heavy packages again at every start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from memtrain.monitor.startup import StartupClock

ROOT = Path(__file__).resolve().parents[2]


def test_phases_sum_to_the_time_from_the_origin():
    ticks = iter([101.5, 104.0, 104.25, 110.0])
    clock = StartupClock(origin_s=100.0, now=lambda: next(ticks))
    for phase in ("launch", "model", "model", "first_step"):
        clock.mark(phase)
    assert clock.record() == {"first_step_s": 10.0, "phases_s": {"launch": 1.5, "model": 2.75, "first_step": 5.75}}


def _note_in_child(tmp_path, **env) -> str:
    """bytecode_note for a tiny package imported by a fresh Python with `env` (a real import, real bytecode)."""
    package = tmp_path / "tinypkg"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text("VALUE = 1\n")
    code = "import tinypkg; from memtrain.monitor.startup import bytecode_note; print(bytecode_note(('tinypkg',)))"
    child_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    child_env.update(PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]), **env)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=child_env, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_a_start_that_keeps_no_bytecode_is_named_and_one_that_does_is_not(tmp_path):
    cache = tmp_path / "pycache"
    note = _note_in_child(tmp_path, PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=str(cache))
    assert "no bytecode for tinypkg" in note and "PYTHONDONTWRITEBYTECODE is set" in note
    assert not cache.exists()  # nothing was written: the next start compiles again
    assert _note_in_child(tmp_path, PYTHONPYCACHEPREFIX=str(cache)) == "None"  # written on import, found after it
    assert any(cache.rglob("__init__*.pyc"))


def test_a_worker_goes_on_from_the_launchers_clock_with_its_own_start_as_workers():
    """Two processes: the workers' start-up record begins at the command (the launcher's phases), not at their own
    start; the time between the launcher's last mark and the worker's clock is "workers"."""
    import time

    ticks = iter([100.0, 101.5])
    launcher = StartupClock(origin_s=99.0, now=lambda: next(ticks))
    launcher.mark("launch")
    launcher.mark("plan")
    worker = StartupClock.from_env(launcher.to_env())
    assert worker.origin_s == 99.0
    assert list(worker.phases_s) == ["launch", "plan", "workers"]
    assert worker.phases_s["launch"] == 1.0 and worker.phases_s["plan"] == 1.5
    assert worker.phases_s["workers"] == pytest.approx(time.time() - 101.5, abs=5.0)
    assert worker.elapsed_s == pytest.approx(sum(worker.phases_s.values()))
    for unreadable in (None, "", "{", '{"origin_s": 1}'):  # no launcher, or a clock that cannot be read: this process's
        assert StartupClock.from_env(unreadable).phases_s == {}
