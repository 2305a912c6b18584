"""Resume compares the recipe with the checkpoint's, and follows the changes it can follow exactly.

Every checkpoint records the resolved recipe it was trained with (`LoopState.recipe`). Before any
work, `check_resume` compares it with the recipe of this invocation, key by key:
- a change that would silently break the run (the model, the data and its sequence length, the global
  batch, which the data position is computed from, the optimizer's kind, the precision, the ZeRO
  layout, the seed, the number of GPUs) is refused with the list of differences and the two ways out;
- a change that is safe mid-run (learning rate and schedule, weight decay, betas, clipping, run
  length, evaluation / save / log cadence, micro-batch and its policy, recomputation, the card) is
  applied, and said so. `follow_recipe` applies what DeepSpeed's checkpoint would otherwise restore
  (the scheduler's base LRs and the optimizer's hyperparameters); the rest is read from the recipe anyway.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from memtrain.errors import Problem, UserError
from memtrain.recipe.schema import Recipe
from memtrain.train.checkpoint import STATE_FILE, LoopState, latest_checkpoint
from memtrain.train.run import ResolvedRun, RunOptions

# Keys (globs over dotted paths) a resumed run can change and still continue exactly; any other change
# is refused. A new recipe key is refused until it is listed here: the safe side when nobody decided.
SAFE_TO_CHANGE = (
    "name", "extends",
    "optimizer.lr", "optimizer.weight_decay", "optimizer.betas", "optimizer.eps", "optimizer.grad_clip",
    "schedule.*",
    "train.steps", "train.epochs", "train.eval_every", "train.eval_batches", "train.save_every", "train.keep_last",
    "train.log_every", "train.output_dir", "train.compile", "train.max_bad_steps",
    "batch.micro_batch", "batch.policy", "batch.adaptive.*",
    "checkpointing.*",
    "hardware.gpu", "hardware.host_memory", "hardware.cap_memory", "hardware.expandable_segments", "hardware.nvme_path",
    "offload.pin_memory", "offload.overlap_comm", "offload.buffer_count", "offload.max_live_parameters",
    "offload.prefetch_bucket_size", "offload.bucket_size", "offload.aio.*",
    "data.cache_dir",
    "model.kernels",  # Liger's kernels compute the same functions; the weights and optimizer states are alike
    "precision.loss_scale.*",
)
# Changes whose new value the batch policy must start from (its saved state would restore the old one).
BATCH_POLICY_KEYS = ("batch.micro_batch", "batch.policy", "batch.adaptive.*")


@dataclass(frozen=True)
class Change:
    key: str
    old: object
    new: object

    def __str__(self) -> str:
        return f"{self.key} {_show(self.old)} → {_show(self.new)}"


@dataclass(frozen=True)
class ResumePlan:
    checkpoint: Path
    step: int
    applied: tuple[Change, ...]

    def lines(self) -> list[str]:
        lines = [f"resuming from step {self.step} (checkpoint {self.checkpoint})"]
        if self.applied:
            lines.append("changed since the checkpoint, applied from here on: " + "; ".join(map(str, self.applied)))
        return lines


def flatten(data: dict, prefix: str = "") -> dict[str, object]:
    """{'a': {'b': 1}} -> {'a.b': 1}; lists stay values."""
    flat: dict[str, object] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{path}."))
        else:
            flat[path] = value
    return flat


def differences(old: dict, new: dict) -> tuple[list[Change], list[Change]]:
    """(changes that break exactness, changes safe to apply) between two recipes as JSON dicts."""
    a, b = flatten(old), flatten(new)
    breaking, safe = [], []
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            change = Change(key, a.get(key), b.get(key))
            (safe if _matches(key, SAFE_TO_CHANGE) else breaking).append(change)
    return breaking, safe


def recorded_recipe(checkpoint: Path) -> dict:
    """The recipe a checkpoint was trained with ({} when it predates the record)."""
    try:
        return json.loads((checkpoint / STATE_FILE).read_text()).get("recipe") or {}
    except (OSError, ValueError):
        return {}


def checkpoint_step(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / STATE_FILE).read_text())["step"])


def check_resume(run: ResolvedRun, options: RunOptions) -> ResumePlan | None:
    """What resuming this run means (None: it starts from step 0); raises UserError when the recipe
    changed in a way the checkpoint cannot follow exactly."""
    if not options.resume or options.overwrite:
        return None
    checkpoint = latest_checkpoint(run.run_dir)
    if checkpoint is None:
        return None
    step = checkpoint_step(checkpoint)
    old = recorded_recipe(checkpoint)
    breaking, safe = differences(old, recipe_json(run.recipe)) if old else ([], [])
    problems = [Problem(f"changed since the checkpoint: {change}", key=change.key) for change in breaking]
    if step > run.total_steps:
        problems.append(Problem(f"the checkpoint is at step {step}, past this recipe's {run.total_steps} steps",
                                key="train.steps"))
    if problems:
        problems.append(Problem(
            f"cannot resume {checkpoint} exactly with this recipe",
            hint="undo the change to resume, or start a new run: in another directory (train.output_dir=runs/NEW) "
                 "or over this one (--no-resume --overwrite moves the old run aside)"))
        raise UserError(problems)
    return ResumePlan(checkpoint, step, tuple(safe))


def recipe_json(recipe: Recipe) -> dict:
    return recipe.model_dump(mode="json")


def optimizer_settings(engine, scheduler) -> tuple[list[float], list[dict]]:
    """The recipe's optimizer settings as built (before a checkpoint overwrites them): the scheduler's base
    LRs and each parameter group's hyperparameters."""
    groups = [{k: g[k] for k in ("weight_decay", "betas", "eps") if k in g} for g in engine.optimizer.param_groups]
    return list(scheduler.base_lrs), groups


def follow_recipe(engine, scheduler, state: LoopState, recipe: Recipe, built: tuple[list[float], list[dict]]) -> None:
    """After loading a checkpoint: run on with this recipe's LR, schedule and optimizer hyperparameters
    (`built`, from `optimizer_settings` before the load) and, when the batch keys changed, its batch policy.

    With nothing changed this sets the values the checkpoint already held, so an exact resume stays exact.
    """
    base_lrs, groups = built
    scheduler.base_lrs = list(base_lrs)
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, settings, lr in zip(engine.optimizer.param_groups, groups, lrs):
        group.update(settings)
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports until the next step
    if state.recipe:
        _, safe = differences(state.recipe, recipe_json(recipe))
        if any(_matches(change.key, BATCH_POLICY_KEYS) for change in safe):
            state.batch_policy = {}  # start from the recipe's micro-batch and policy, not the saved ones
    state.recipe = recipe_json(recipe)


def _matches(key: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatchcase(key, pattern) for pattern in patterns)


def _show(value: object) -> str:
    return "(unset)" if value is None else json.dumps(value) if isinstance(value, (list, dict, str)) else str(value)
