"""Runs that cannot be mixed, lost or silently wrong: end to end on DeepSpeed's CPU accelerator."""
from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from memtrain.cli import app
from memtrain.commands.run import run_command
from memtrain.train.checkpoint import complete_checkpoints
from memtrain.train.run import RunOptions
from memtrain.train.schedule import lr_multiplier
from tests.conftest import read_records
from tests.train.test_run import run_dir_of

pytestmark = pytest.mark.slow


def run(path: Path, *overrides: str, **options) -> tuple[int, str]:
    """`memtrain run` in this process: (exit code, what it printed)."""
    out = io.StringIO()
    code = run_command(path, list(overrides), RunOptions(**options), console=Console(file=out, width=300))
    return code, out.getvalue()


def cli(*args: str):
    return CliRunner().invoke(app, ["run", *map(str, args)])


def train_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_records(run_dir, "train")]


def test_no_resume_into_a_used_directory_is_refused_and_overwrite_starts_over(write_recipe):
    recipe = write_recipe("owned", {"train": {"steps": 6, "save_every": 3, "eval_every": 100}})
    assert run(recipe)[0] == 0
    run_dir = run_dir_of(recipe)
    before = sorted(p.name for p in complete_checkpoints(run_dir))
    refused = cli(recipe, "--no-resume", "train.steps=4")
    assert refused.exit_code == 2, refused.output
    assert "train.output_dir" in refused.output and "--overwrite" in refused.output
    assert "Traceback" not in refused.output
    assert sorted(p.name for p in complete_checkpoints(run_dir)) == before  # the old run is untouched

    assert cli(recipe, "--no-resume", "--overwrite", "train.steps=4").exit_code == 0
    [old] = run_dir.parent.glob("owned.previous-*")
    assert train_steps(old) == [1, 2, 3, 4, 5, 6]  # moved aside whole
    assert train_steps(run_dir) == [1, 2, 3, 4]  # the new run's metrics hold the new run only
    assert [r["event"] for r in read_records(run_dir, "run")] == ["start", "end"]
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step-000003", "step-000004"]


def test_a_resumed_run_drops_the_records_of_the_steps_it_redoes(write_recipe):
    recipe = write_recipe("redo", {"train": {"steps": 10, "save_every": 5, "eval_every": 100}})
    assert run(recipe, max_steps=7)[0] == 0
    run_dir = run_dir_of(recipe)
    shutil.rmtree(run_dir / "checkpoints" / "step-000007")  # as if killed after step 7, before its save
    code, said = run(recipe)
    assert code == 0
    assert "resuming from step 5 (checkpoint" in said
    assert train_steps(run_dir) == list(range(1, 11))  # steps 6 and 7 once: the redone records replaced

    from memtrain.commands.report import report_command

    out = io.StringIO()
    report_command(run_dir, as_json=True, console=Console(file=out))
    assert '"steps": 10' in out.getvalue()


def test_resume_refuses_changes_that_break_exactness_and_lists_them(write_recipe):
    recipe = write_recipe("strict", {"train": {"steps": 12, "save_every": 6, "eval_every": 100}})
    assert run(recipe, max_steps=6)[0] == 0
    refused = cli(recipe, "data.seq_len=64", "batch.global_batch=16", "train.seed=8", "model.lora.r=4")
    assert refused.exit_code == 2, refused.output
    for change in ("data.seq_len", "32 → 64", "batch.global_batch", "8 → 16", "train.seed", "model.lora.r"):
        assert change in refused.output, change
    assert "train.output_dir" in refused.output and "--overwrite" in refused.output
    assert "Traceback" not in refused.output
    assert train_steps(run_dir_of(recipe)) == list(range(1, 7))  # nothing ran


def test_resume_applies_a_new_learning_rate_and_says_so(write_recipe):
    recipe = write_recipe("newlr", {"train": {"steps": 12, "save_every": 6, "eval_every": 100}})
    assert run(recipe, max_steps=6)[0] == 0
    code, said = run(recipe, "optimizer.lr=1e-3", "train.eval_every=3")
    assert code == 0, said
    assert "resuming from step 6" in said and "optimizer.lr 0.003 → 0.001" in said
    run_dir = run_dir_of(recipe)
    from memtrain.recipe.schema import Schedule

    lrs = {r["step"]: r["lr"] for r in read_records(run_dir, "train")}
    schedule = Schedule(warmup_steps=2, decay="cosine")
    # the lr logged at step 7 is the one the scheduler set for the next update, as in a straight run
    assert lrs[7] == pytest.approx(1e-3 * lr_multiplier(7, schedule, 12), rel=1e-6)
    assert lrs[6] == pytest.approx(3e-3 * lr_multiplier(6, schedule, 12), rel=1e-6)
    import json

    assert json.loads((run_dir / "recipe.json").read_text())["optimizer"]["lr"] == 1e-3
    assert [e["step"] for e in read_records(run_dir, "eval")] == [6, 9, 12]  # the new cadence after step 6


def test_a_checkpoint_past_the_recipes_steps_is_refused(write_recipe):
    recipe = write_recipe("past", {"train": {"steps": 8, "save_every": 4, "eval_every": 100}})
    assert run(recipe)[0] == 0
    refused = cli(recipe, "train.steps=4")
    assert refused.exit_code == 2 and "past this recipe's 4 steps" in refused.output, refused.output
