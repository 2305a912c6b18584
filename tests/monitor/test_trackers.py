"""The trackers receive what metrics.jsonl receives, and a reopened tracker continues the same tracker run."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from memtrain.cli import app
from memtrain.monitor.metrics import MetricsLog, read_metrics
from memtrain.monitor.trackers import MLFLOW_DIR, TRACKERS_FILE, open_trackers, tracker_problems
from tests.monitor.tracker_files import mlflow_metric, mlflow_params, wandb_history

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

RECIPE = {"model": {"preset": "micro"}, "optimizer": {"lr": 0.003, "betas": [0.9, 0.95]}}
FIGURES = {"micro_batch": 4, "total_steps": 6, "peak_reserved_bytes": 123456}


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def log_steps(run_dir, steps):
    trackers = open_trackers(["wandb", "mlflow"], run_dir, "tiny", RECIPE, FIGURES)
    with MetricsLog(run_dir / "metrics.jsonl", flush_every=2, trackers=trackers) as log:
        for step in steps:
            log.record("train", step, loss=10.0 / step, lr=0.001, note="text is left to metrics.jsonl")
        log.event("eval", steps[-1], loss=1.5)


def test_wandb_offline_and_an_mlflow_file_store_get_every_metric_and_a_resume_appends(tmp_path, offline):
    run_dir = tmp_path / "run"
    log_steps(run_dir, [1, 2, 3])
    log_steps(run_dir, [3, 4, 5])  # resumed from the checkpoint at step 2: step 3 is trained again
    written = [(r["step"], r["loss"]) for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert written == [(1, 10.0), (2, 5.0), (3, 10 / 3), (3, 10 / 3), (4, 2.5), (5, 2.0)]

    rows, config, ids = wandb_history(run_dir)
    assert len(ids) == 1  # one W&B run, continued
    assert [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r] == written
    assert [(r["step"], r["eval/loss"]) for r in rows if "eval/loss" in r] == [(3, 1.5), (5, 1.5)]
    assert config["recipe"] == RECIPE and config["plan"] == FIGURES

    store = run_dir / MLFLOW_DIR
    losses = mlflow_metric(store, "train/loss")
    assert len(losses) == 1  # one MLflow run, continued
    ((run_id, history),) = losses.items()
    assert [step for step, _ in history] == [step for step, _ in written]
    assert [value for _, value in history] == pytest.approx([value for _, value in written])
    assert list(mlflow_metric(store, "eval/loss").values()) == [[(3, 1.5), (5, 1.5)]]
    params = mlflow_params(store, run_id)
    assert params["recipe.optimizer.lr"] == "0.003" and params["recipe.optimizer.betas"] == "[0.9, 0.95]"
    assert params["plan.peak_reserved_bytes"] == "123456"
    assert (run_dir / TRACKERS_FILE).is_file()


def test_a_tracker_that_cannot_start_is_said_before_any_work(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: W&B has no key
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # the discard port: nothing answers
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    problems = tracker_problems(["wandb", "mlflow"])
    assert [p.key for p in problems] == ["train.report_to", "train.report_to"]
    assert "wandb, which cannot start" in problems[0].message and "WANDB_MODE=offline" in problems[0].hint
    assert "http://127.0.0.1:9 does not answer" in problems[1].message
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert tracker_problems(["wandb", "mlflow"]) == []


def test_run_stops_before_any_work_when_a_tracker_cannot_start(write_recipe, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    recipe = write_recipe("tracked", {"train": {"report_to": ["mlflow"]}})
    result = CliRunner().invoke(app, ["run", str(recipe)])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert "tracked.yaml:" in said and "train.report_to names mlflow" in said and "Traceback" not in result.output
    assert not (recipe.parent / "runs" / "tracked").exists()  # nothing written


class Unreachable:
    """A tracker whose server went away mid-run."""

    def __init__(self):
        self.closed = False

    def write(self, records):
        raise ConnectionError("server gone")

    def close(self):
        self.closed = True


def test_a_tracker_that_fails_mid_run_is_dropped_and_the_run_goes_on(tmp_path, capsys):
    with MetricsLog(tmp_path / "metrics.jsonl", flush_every=1, trackers=[Unreachable()]) as log:
        log.record("train", 1, loss=2.0)
        log.record("train", 2, loss=1.0)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    said = capsys.readouterr().err
    assert said.count("Unreachable stopped receiving metrics (ConnectionError: server gone)") == 1
