"""The line a run ends with says where its checkpoint is, and says nothing was saved when --no-save kept it from
being written (it used to point at a checkpoint that did not exist)."""

from __future__ import annotations

import signal
from pathlib import Path

from memtrain.train.runtime.result import RunResult


def test_a_stopped_or_interrupted_run_points_at_its_checkpoint():
    run_dir = Path("/runs/a")
    assert "checkpoint in /runs/a/checkpoints" in RunResult("stopped", 3, run_dir).summary()
    assert "checkpoint in /runs/a/checkpoints" in RunResult("interrupted", 3, run_dir).summary()


def test_under_no_save_it_says_nothing_was_saved():
    stopped = RunResult("stopped", 3, Path("/runs/a"), saved=False).summary()
    interrupted = RunResult("interrupted", 3, Path("/runs/a"), saved=False).summary()
    assert stopped == "stopped at step 3 as asked (--max-steps); nothing saved (--no-save)"
    assert interrupted == "interrupted at step 3; nothing saved (--no-save)"


def test_a_finished_run_counts_its_steps_in_words():
    assert (
        RunResult("done", 1, Path("/runs/a"), saved=False).summary() == "trained 1 step; metrics in /runs/a (--no-save)"
    )
    assert (
        RunResult("done", 2, Path("/runs/a"), exported=Path("/runs/a/final")).summary()
        == "trained 2 steps; model in /runs/a/final"
    )


def test_a_stop_during_an_export_that_finished_is_a_done_run_that_says_so(tmp_path):
    result = RunResult(
        status="done", step=4, run_dir=tmp_path, exported=tmp_path / "final", stopped_after_export=signal.SIGTERM
    )
    assert result.exit_code == 0 and result.finished
    assert result.summary() == (
        f"trained 4 steps; model in {tmp_path / 'final'} (stopped by SIGTERM during the export, which finished: "
        "the model is complete, nothing is left to run)"
    )
