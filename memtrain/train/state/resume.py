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

The data is compared too, since a recipe can name the same file after its contents changed: run.json holds the
fingerprint of the samples as built (`ResolvedRun.data_fingerprint`, memtrain.data.rows.identity), and a different one
is refused at the key that names the data. run.json in the run directory is the one to compare with: it is
rewritten only by a run that passed this check (or by a fresh run, which has no checkpoint to compare), so it
names the data the newest checkpoint was trained on. A run.json without a fingerprint (an older memtrain's)
resumes as before, with a note that the data could not be compared.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from memtrain.data.rows.identity import TRAIN_KEY
from memtrain.errors import Problem, UserError
from memtrain.recipe.load import absolute_input_paths
from memtrain.recipe.schema import Recipe
from memtrain.train.resolve import RUN_FILE, ResolvedRun, RunOptions
from memtrain.train.state.checkpoint import STATE_FILE, LoopState, latest_checkpoint

# Keys (globs over dotted paths) a resumed run can change and still continue exactly; any other change
# is refused. A new recipe key is refused until it is listed here: the safe side when nobody decided.
SAFE_TO_CHANGE = (
    "name",
    "extends",
    "optimizer.lr",
    "optimizer.weight_decay",
    "optimizer.betas",
    "optimizer.eps",
    "optimizer.grad_clip",
    "schedule.*",
    "train.steps",
    "train.epochs",
    "train.eval_every",
    "train.eval_batches",
    "train.save_every",
    "train.keep_last",
    "train.log_every",
    "train.output_dir",
    "train.compile",
    "train.cuda_graphs",  # how the same kernels are launched, not what they compute
    "train.max_bad_steps",
    "train.report_to",  # where the metrics go, not what is trained
    # held-out questions answered at step 0 and at the end, greedily and with the RNG states restored around it
    # (train/eval/generation.py): which and how many never reach the training math or the sample order
    "train.eval_generate",
    "batch.micro_batch",
    "batch.policy",
    "batch.adaptive.*",
    "checkpointing.*",
    "hardware.gpu",
    "hardware.host_memory",
    "hardware.cap_memory",
    "hardware.expandable_segments",
    "hardware.nvme_path",
    "offload.pin_memory",
    "offload.overlap_comm",
    "offload.buffer_count",
    "offload.max_live_parameters",
    "offload.prefetch_bucket_size",
    "offload.bucket_size",
    "offload.aio.*",
    "data.cache_dir",
    "model.kernels",  # Liger's kernels compute the same functions; the weights and optimizer states are alike
    "model.attn_implementation",  # every kernel computes the same attention (auto resolves per machine)
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
    notes: tuple[str, ...] = ()  # what could not be checked, for people

    def lines(self) -> list[str]:
        lines = [f"resuming from step {self.step} (checkpoint {self.checkpoint})"]
        if self.applied:
            lines.append("changed since the checkpoint, applied from here on: " + "; ".join(map(str, self.applied)))
        return lines + list(self.notes)


def differences(old: dict, new: dict) -> tuple[list[Change], list[Change]]:
    """(changes that break exactness, changes safe to apply) between two recipes as JSON dicts, each at the
    deepest key where they differ: a list of datasets item by item (data.train.0.path), a section that was not
    set as one change (model.lora (unset) → {...}, not one per field of it)."""
    breaking, safe = [], []
    for change in sorted(_changes(old, new, ""), key=lambda change: change.key):
        (safe if _matches(change.key, SAFE_TO_CHANGE) else breaking).append(change)
    return breaking, safe


def _changes(old: object, new: object, key: str) -> list[Change]:
    if isinstance(old, dict) and isinstance(new, dict):
        return [
            change
            for name in {**old, **new}
            for change in _changes(old.get(name), new.get(name), f"{key}.{name}" if key else name)
        ]
    if (
        isinstance(old, list)
        and isinstance(new, list)
        and len(old) == len(new)
        and all(isinstance(item, dict) for item in old + new)
    ):
        return [change for i, (a, b) in enumerate(zip(old, new)) for change in _changes(a, b, f"{key}.{i}")]
    return [Change(key, old, new)] if old != new else []


def recorded_recipe(checkpoint: Path) -> dict:
    """The recipe a checkpoint was trained with ({} when it predates the record), its input paths absolute as
    today's recipe has them (`absolute_input_paths`)."""
    try:
        recipe = json.loads((checkpoint / STATE_FILE).read_text()).get("recipe") or {}
    except (OSError, ValueError):
        return {}
    return with_recorded_zero_stage(absolute_input_paths(recipe)) if isinstance(recipe, dict) else {}


def with_recorded_zero_stage(recipe: dict) -> dict:
    """A recorded recipe with offload.zero_stage 'auto' made the stage it ran with. Runs record the stage itself
    (memtrain.train.resolve.with_zero_stage); a recorded 'auto' comes from a memtrain whose 'auto' meant 3 with
    parameters offloaded or optimizer states on NVMe, else 2 (one GPU too), and those checkpoints hold that stage's
    optimizer files."""
    offload = recipe.get("offload")
    if not isinstance(offload, dict) or offload.get("zero_stage") != "auto":
        return recipe
    stage = 3 if offload.get("params", "none") != "none" or offload.get("optimizer") == "nvme" else 2
    return {**recipe, "offload": {**offload, "zero_stage": stage}}


def recorded_data_files(run_dir: Path) -> dict[str, list[str]] | None:
    """The fingerprints of the data files the run in `run_dir` read (identity.data_files); None when its run.json
    has none (written before data files were recorded)."""
    return _recorded(run_dir, "data_files")


def recorded_data_fingerprint(run_dir: Path) -> dict[str, str] | None:
    """The data fingerprint of the run in `run_dir` (see the module doc); None when its run.json has none."""
    return _recorded(run_dir, "data_fingerprint")


def _recorded(run_dir: Path, name: str) -> dict | None:
    """A {recipe key: ...} record of the run.json in `run_dir`; None when it has none (or no run.json)."""
    try:
        recorded = json.loads((run_dir / RUN_FILE).read_text()).get(name)
    except (OSError, ValueError, AttributeError):
        return None
    return recorded if isinstance(recorded, dict) and recorded else None


def changed_data_keys(old: dict, new: dict) -> list[str]:
    """The recipe keys whose data differs between two records of it (as built, or its files' fingerprints)."""
    return [key for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]


def named_files(key: str, recipe: Recipe) -> str:
    """The files a data key of the recipe lists, for messages."""
    named = recipe.data.train if key == TRAIN_KEY else recipe.data.validation
    return ", ".join([named] if isinstance(named, str) else [spec.path for spec in named or []]) or key


def data_problem(key: str, run: ResolvedRun, other_changes: bool) -> Problem:
    """A data key whose samples changed since the checkpoint, named by the files it lists."""
    files = named_files(key, run.recipe)
    causes = [
        "a file's contents changed",
        "the tokenizer or its chat template changed (model.path, model.tokenizer)",
        "memtrain now tokenises this data otherwise (chat data, after an upgrade)",
    ]
    if other_changes:
        causes.append("a change listed here")
    return Problem(
        f"changed since the checkpoint: the samples built from {files} differ from those the checkpoint "
        f"was trained on ({'; or '.join(causes)})",
        key=key,
        hint="put back the data and tokenizer the run was trained on to resume it",
    )


UNCOMPARED_DATA_NOTE = (
    "note: the data could not be compared with the checkpoint's (its run.json, from an older "
    "memtrain, records no data fingerprint): make sure the data files hold what it was trained on"
)


def checkpoint_step(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / STATE_FILE).read_text())["step"])


def check_resume(run: ResolvedRun, options: RunOptions) -> ResumePlan | None:
    """What resuming this run means (None: it starts from step 0); raises UserError when the recipe, or the data
    it names, changed in a way the checkpoint cannot follow exactly."""
    if not options.resume or options.overwrite:
        return None
    checkpoint = latest_checkpoint(run.run_dir)
    if checkpoint is None:
        return None
    step = checkpoint_step(checkpoint)
    old = recorded_recipe(checkpoint)
    breaking, safe = differences(old, recipe_json(run.recipe)) if old else ([], [])
    problems = [
        Problem(f"changed since the checkpoint: {change}", key=change.key, hint=_change_hint(change))
        for change in breaking
    ]
    recorded, notes = recorded_data_fingerprint(run.run_dir), ()
    if recorded is None or run.data_fingerprint is None:
        notes = (UNCOMPARED_DATA_NOTE,)
    else:
        problems += [
            data_problem(key, run, bool(breaking)) for key in changed_data_keys(recorded, run.data_fingerprint)
        ]
    if step > run.total_steps:
        problems.append(
            Problem(f"the checkpoint is at step {step}, past this recipe's {run.total_steps} steps", key="train.steps")
        )
    if problems:
        raise UserError([*problems, _cannot_resume(checkpoint)])
    return ResumePlan(checkpoint, step, tuple(safe), notes)


def refuse_changed_files(run_dir: Path, options: RunOptions, recipe: Recipe, files: dict[str, list[str]]) -> None:
    """Before the data is built: refuse to resume when a file the data names holds other bytes than when the run
    recorded it (run.json's data_files), so that is said at once, not after the file is tokenised again (minutes
    for a large one). check_resume still compares the data as built (the tokenizer, the template, memtrain's own
    tokenising) once it is. Nothing to compare: no checkpoint, not resuming, or a run.json without data_files."""
    checkpoint = latest_checkpoint(run_dir) if options.resume and not options.overwrite else None
    if checkpoint is None:
        return
    old, new = recorded_recipe(checkpoint).get("data") or {}, recipe_json(recipe)["data"]
    if any(old.get(key) != new.get(key) for key in ("train", "validation", "format", "field")):
        return  # the recipe names other data: check_resume says what changed in it, not that bytes did
    recorded = recorded_data_files(run_dir)
    changed = changed_data_keys(recorded, files) if recorded is not None else []
    if changed:
        raise UserError([*(_changed_files_problem(key, recipe) for key in changed), _cannot_resume(checkpoint)])


def _changed_files_problem(key: str, recipe: Recipe) -> Problem:
    return Problem(
        f"changed since the checkpoint: {named_files(key, recipe)} no longer holds the bytes the "
        "checkpoint was trained on",
        key=key,
        hint="put back the data files the run was trained on to resume it",
    )


def _change_hint(change: Change) -> str:
    """The way back for a change with one: a Hub model whose branch moved is resumed on the commit it trained."""
    if change.key == "offload.zero_stage" and isinstance(change.old, int):
        return (
            f"the checkpoint's optimizer files were written by ZeRO stage {change.old}: set "
            f"offload.zero_stage={change.old} to resume it"
        )
    if change.key == "model.revision" and isinstance(change.old, str):
        return (
            f"the Hub repo's revision now names another commit: pin model.revision={change.old} to resume on the "
            "weights the checkpoint was trained on"
        )
    return ""


def _cannot_resume(checkpoint: Path) -> Problem:
    return Problem(
        f"cannot resume {checkpoint} exactly with this recipe",
        hint="undo the change to resume, or start a new run: in another directory (train.output_dir="
        "runs/NEW) or over this one (--no-resume --overwrite moves the old run aside)",
    )


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
