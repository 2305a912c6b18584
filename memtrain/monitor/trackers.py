"""The experiment trackers a run reports to (`train.report_to`): TensorBoard, Weights & Biases, MLflow.

Each receives what metrics.jsonl receives, record by record as `MetricsLog` flushes them (no second logging path):
every numeric field as `<kind>/<field>` at the record's step. W&B and MLflow also receive the recipe (W&B's config,
MLflow's params, dotted keys) and the plan's figures. Only rank 0 reports. The tracker's run id is kept in the run
directory (trackers.json), so a resumed run appends to the same tracker run.

Offline: W&B honours WANDB_MODE=offline (its files under RUN_DIR/wandb, `wandb sync` uploads them later); MLflow
writes a file store under RUN_DIR/mlruns unless MLFLOW_TRACKING_URI names another store (MLFLOW_EXPERIMENT_NAME, else
'memtrain'). W&B's project is WANDB_PROJECT, else 'memtrain'.

`tracker_problems` is asked before any work (a package not installed, W&B not logged in, an MLflow server out of
reach), so that is said at start, with exit 2, not after hours of training.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from memtrain.errors import Problem
from memtrain.files import write_atomically
from memtrain.monitor.tensorboard import TensorBoardWriter, tensorboard_available

TRACKERS_FILE = "trackers.json"  # the tracker runs' ids, for a resume to continue them
TENSORBOARD_DIR = "tensorboard"
MLFLOW_DIR = "mlruns"
WANDB_OFFLINE_MODES = ("offline", "disabled", "dryrun")
# Fields of a record that are bookkeeping, not curves.
_NOT_SCALARS = {"kind", "step", "time"}
# MLflow's limits: params per log_batch call, characters of a param's value, metrics per call
_MLFLOW_PARAMS_PER_BATCH = 100
_MLFLOW_PARAM_CHARS = 6000
_MLFLOW_METRICS_PER_BATCH = 1000


class Tracker(Protocol):
    def write(self, records: list[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric fields as `<kind>/<field>` (strings, nulls and flags are left to metrics.jsonl)."""
    return {
        f"{record['kind']}/{name}": value
        for name, value in record.items()
        if name not in _NOT_SCALARS and not isinstance(value, bool) and isinstance(value, (int, float))
    }


def chosen_trackers(report_to: Sequence[str] | None) -> list[str]:
    """The trackers a run opens: the recipe's list, or by default TensorBoard where its package is installed."""
    if report_to is None:
        return ["tensorboard"] if tensorboard_available() else []
    return list(dict.fromkeys(report_to))


def tracker_problems(report_to: Sequence[str] | None) -> list[Problem]:
    """What stops a tracker the recipe names from starting, said before any work (key train.report_to)."""
    problems = []
    for name in chosen_trackers(report_to):
        if importlib.util.find_spec(name) is None:
            problems.append(
                Problem(
                    f"train.report_to names {name}, whose package is not installed",
                    key="train.report_to",
                    hint=f"pip install 'memtrain[{name}]', or remove {name} from train.report_to",
                )
            )
        elif name == "wandb":
            problems += _wandb_problems()
        elif name == "mlflow":
            problems += _mlflow_problems()
    return problems


def open_trackers(
    report_to: Sequence[str] | None, run_dir: Path, name: str, recipe: dict, figures: dict[str, Any]
) -> list[Tracker]:
    """Start (or, with a trackers.json in the run directory, continue) each tracker run; rank 0 only."""
    run_dir = Path(run_dir)
    ids = _read_ids(run_dir)
    trackers: list[Tracker] = []
    for tracker in chosen_trackers(report_to):
        if tracker == "tensorboard":
            trackers.append(TensorBoardTracker(run_dir / TENSORBOARD_DIR))
        elif tracker == "wandb":
            trackers.append(WandbTracker(run_dir, name, recipe, figures, ids))
        elif tracker == "mlflow":
            trackers.append(MlflowTracker(run_dir, name, recipe, figures, ids))
    if ids:
        _write_ids(run_dir, ids)
    return trackers


class TensorBoardTracker:
    """TensorBoard's event files under RUN_DIR/tensorboard (monitor/tensorboard.py writes them)."""

    def __init__(self, log_dir: Path):
        self._writer = TensorBoardWriter(log_dir)

    def write(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            self._writer.add(record)

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A W&B run whose step axis is the record's step (define_metric), so records of any kind and a resume that
    goes back to its checkpoint's step are kept, not dropped as out of order."""

    def __init__(self, run_dir: Path, name: str, recipe: dict, figures: dict[str, Any], ids: dict):
        import wandb  # noqa: PLC0415 — an optional extra, imported only when the recipe reports to W&B

        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "memtrain"),
            name=name,
            id=ids.get("wandb"),  # None: a new run, whose id is kept for a resume
            resume="allow",
            dir=str(run_dir),
            config={"recipe": recipe, "plan": figures},
            allow_val_change=True,  # a resume may change what resume allows to change (the learning rate, ...)
        )
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")
        ids["wandb"] = self._run.id

    def write(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            values = scalars(record)
            if values:
                self._run.log({"step": int(record["step"]), **values})

    def close(self) -> None:
        self._run.finish()


class MlflowTracker:
    """An MLflow run: the recipe as params (dotted keys), the plan's figures as `plan.*` params, metrics in batches."""

    def __init__(self, run_dir: Path, name: str, recipe: dict, figures: dict[str, Any], ids: dict):
        from mlflow.entities import Param  # noqa: PLC0415 — an optional extra
        from mlflow.tracking import MlflowClient  # noqa: PLC0415

        uri = mlflow_uri(run_dir)
        self._client = MlflowClient(tracking_uri=uri)
        recorded = ids.get("mlflow") or {}
        self.run_id = recorded.get("run_id") if recorded.get("tracking_uri") == uri else None
        if self.run_id is not None:
            self._client.update_run(self.run_id, status="RUNNING")
        else:
            experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "memtrain")
            experiment = self._client.get_experiment_by_name(experiment_name)
            experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(experiment_name)
            self.run_id = self._client.create_run(experiment_id, run_name=name).info.run_id
            params = [Param(key, value) for key, value in flat_params({"recipe": recipe, "plan": figures}).items()]
            for start in range(0, len(params), _MLFLOW_PARAMS_PER_BATCH):
                self._client.log_batch(self.run_id, params=params[start : start + _MLFLOW_PARAMS_PER_BATCH])
        ids["mlflow"] = {"run_id": self.run_id, "tracking_uri": uri}

    def write(self, records: list[dict[str, Any]]) -> None:
        from mlflow.entities import Metric  # noqa: PLC0415 — an optional extra

        metrics = [
            Metric(key, float(value), int(record["time"] * 1000), int(record["step"]))
            for record in records
            for key, value in scalars(record).items()
        ]
        for start in range(0, len(metrics), _MLFLOW_METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[start : start + _MLFLOW_METRICS_PER_BATCH])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def mlflow_uri(run_dir: Path) -> str:
    """MLFLOW_TRACKING_URI, else a file store in the run directory. MLflow keeps its file store in maintenance and
    refuses it unless MLFLOW_ALLOW_FILE_STORE is set: memtrain sets it for its own default store only."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return (Path(run_dir).resolve() / MLFLOW_DIR).as_uri()


def flat_params(tree: dict, prefix: str = "") -> dict[str, str]:
    """A nested dict as MLflow params: dotted keys, values as text (lists and None as JSON), cut to MLflow's limit."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flat_params(value, f"{name}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            flat[name] = text[:_MLFLOW_PARAM_CHARS]
    return flat


def _wandb_problems() -> list[Problem]:
    if os.environ.get("WANDB_MODE", "").lower() in WANDB_OFFLINE_MODES:
        return []
    import wandb  # noqa: PLC0415 — an optional extra, imported only when the recipe reports to W&B

    try:
        logged_in = wandb.login(prompt=False, verify=True, timeout=30)
    except Exception as error:  # noqa: BLE001 — whatever W&B raises, the run must not start without it
        logged_in, why = False, str(error).splitlines()[0] if str(error) else type(error).__name__
    else:
        why = "no API key"
    if logged_in:
        return []
    return [
        Problem(
            f"train.report_to names wandb, which cannot start: {why}",
            key="train.report_to",
            hint="log in (`wandb login`, or set WANDB_API_KEY), or run offline with WANDB_MODE=offline "
            "(`wandb sync RUN_DIR/wandb/offline-run-*` uploads it later)",
        )
    ]


def _mlflow_problems() -> list[Problem]:
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri or uri.startswith("file:"):
        return []  # a file store is written where the run writes
    from mlflow.tracking import MlflowClient  # noqa: PLC0415 — an optional extra

    try:
        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    except Exception as error:  # noqa: BLE001 — whatever MLflow raises, the run must not start without it
        return [
            Problem(
                f"train.report_to names mlflow, whose tracking server {uri} does not answer: "
                f"{str(error).splitlines()[0] if str(error) else type(error).__name__}",
                key="train.report_to",
                hint="start the server or fix MLFLOW_TRACKING_URI, or unset it to write a file store in the run "
                "directory",
            )
        ]
    return []


def _read_ids(run_dir: Path) -> dict:
    try:
        ids = json.loads((run_dir / TRACKERS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return ids if isinstance(ids, dict) else {}


def _write_ids(run_dir: Path, ids: dict) -> None:
    write_atomically(run_dir / TRACKERS_FILE, json.dumps(ids, indent=2) + "\n")
