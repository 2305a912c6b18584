"""A run reports to W&B (offline) and MLflow (a file store in the run directory): every train and eval record of
metrics.jsonl reaches both, and a resumed run appends to the same tracker runs."""

from __future__ import annotations

import pytest

from memtrain.commands.run import run_command
from memtrain.monitor.trackers import MLFLOW_DIR
from memtrain.train.resolve import RunOptions
from tests.conftest import read_records
from tests.monitor.tracker_files import mlflow_metric, mlflow_params, wandb_history

pytest.importorskip("wandb")
pytest.importorskip("mlflow")
pytestmark = pytest.mark.slow


def test_trackers_receive_the_runs_metrics_and_a_resume_continues_them(write_recipe, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    recipe = write_recipe(
        "tracked", {"train": {"steps": 6, "save_every": 3, "eval_every": 3, "report_to": ["wandb", "mlflow"]}}
    )
    run_dir = tmp_path / "runs" / "tracked"
    assert run_command(recipe, [], RunOptions(max_steps=3)) == 0
    assert run_command(recipe, [], RunOptions()) == 0  # resumed from step 3
    train = [(r["step"], r["loss"]) for r in read_records(run_dir, "train")]
    evals = [(r["step"], r["loss"]) for r in read_records(run_dir, "eval")]
    assert [step for step, _ in train] == [1, 2, 3, 4, 5, 6] and [step for step, _ in evals] == [3, 6]

    rows, config, ids = wandb_history(run_dir)
    assert len(ids) == 1
    assert [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r] == train
    assert [(r["step"], r["eval/loss"]) for r in rows if "eval/loss" in r] == evals
    assert config["recipe"]["train"]["steps"] == 6 and config["plan"]["total_steps"] == 6

    losses = mlflow_metric(run_dir / MLFLOW_DIR, "train/loss")
    assert len(losses) == 1
    ((run_id, history),) = losses.items()
    assert [step for step, _ in history] == [1, 2, 3, 4, 5, 6]
    assert [value for _, value in history] == pytest.approx([loss for _, loss in train])
    assert mlflow_params(run_dir / MLFLOW_DIR, run_id)["recipe.model.preset"] == "micro"
