"""`memtrain eval RUN_DIR --tasks T1,T2`: lm-evaluation-harness tasks on a run's final model.

The model is loaded as `memtrain chat` loads it (memtrain.train.state.saved_model; an adapter merged onto its base in
memory, since the harness takes a transformers model) and handed to the harness's HFLM with the run's tokenizer.
Tasks are the harness's own or YAML definitions in `--include-path` (their data may be local files: offline). Each
task's scores become a "benchmark" record in metrics.jsonl (and the trackers' files are not touched: the run is over),
at the run's last step, with the harness's metric names ("acc,none" -> acc).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from memtrain.errors import Problem, UserError
from memtrain.monitor.metrics import METRICS_FILE, MetricsLog
from memtrain.train.resolve import RUN_FILE
from memtrain.train.state.saved_model import load_saved_model

BENCHMARK_KIND = "benchmark"
_FILTER = ",none"  # the harness's suffix of a metric computed without a filter


def benchmark_run(
    run_dir: Path, tasks: list[str], include_path: Path | None = None, limit: int | None = None, batch_size: int = 8
) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} of the run's final model on `tasks`; each also written to metrics.jsonl."""
    if importlib.util.find_spec("lm_eval") is None:
        raise UserError(
            Problem(
                "--tasks runs lm-evaluation-harness, which is not installed",
                hint="pip install 'memtrain[lmeval]'",
            )
        )
    from lm_eval import simple_evaluate  # noqa: PLC0415 — an optional extra, imported only for --tasks
    from lm_eval.models.huggingface import HFLM  # noqa: PLC0415
    from lm_eval.tasks import TaskManager  # noqa: PLC0415

    if include_path is not None and not Path(include_path).is_dir():
        raise UserError(Problem(f"--include-path {include_path} is not a directory", hint="give the tasks' folder"))
    manager = TaskManager(include_path=str(include_path) if include_path else None)
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        raise UserError(
            Problem(
                f"lm-evaluation-harness has no task {', '.join(unknown)}",
                hint="`lm_eval ls tasks` lists its own; a task of yours goes in a YAML file under --include-path",
            )
        )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    saved = load_saved_model(Path(run_dir), device)
    model = saved.model
    if hasattr(model, "merge_and_unload"):  # a PEFT adapter: the harness takes a transformers model
        model = model.merge_and_unload()
    lm = HFLM(pretrained=model, tokenizer=saved.tokenizer, device=str(device), batch_size=batch_size)
    results = simple_evaluate(
        model=lm, tasks=tasks, task_manager=manager, limit=limit, log_samples=False, bootstrap_iters=0
    )
    scores = {task: _numbers(results["results"].get(task, {})) for task in tasks}
    step = _last_step(Path(run_dir))
    with MetricsLog(Path(run_dir) / METRICS_FILE, flush_every=1) as log:
        for task, values in scores.items():
            log.event(BENCHMARK_KIND, step, task=task, **values)
    return scores


def _numbers(metrics: dict) -> dict[str, float]:
    """A task's numeric metrics by name (stderr left out when the harness did not compute it)."""
    return {
        name.removesuffix(_FILTER): float(value)
        for name, value in metrics.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and name != "alias"
    }


def _last_step(run_dir: Path) -> int:
    """The run's last step (run.json's total_steps), the step its final model was saved at; 0 when unknown."""
    try:
        return int(json.loads((run_dir / RUN_FILE).read_text())["total_steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0
