"""A run resolved once: every 'auto' of the recipe made concrete for this machine, before anything is built.

The launcher resolves the run (asking the planner for the micro-batch and the recomputed layers,
counting the steps from the data), saves it as `run.json` in the run directory, and hands it to the
DeepSpeed config compiler and the loop; workers that torchrun starts read the same file. Nothing
downstream asks the planner again.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from memtrain.errors import Problem, UserError
from memtrain.files import write_atomically
from memtrain.hub import hub_repo, pinned_revision
from memtrain.model.attention import resolve_attention, with_attention
from memtrain.model.compiled import resolve_compile, resolve_cuda_graphs
from memtrain.model.kernels import KernelSupport, resolve_kernels
from memtrain.plan.planner import plan_recipe, resolve_checkpointing, resolve_micro_batch
from memtrain.recipe.schema import Recipe

RUN_FILE = "run.json"


@dataclass(frozen=True)
class RunOptions:
    """How this invocation runs the recipe (the command line's flags), apart from what it runs."""

    resume: bool = True  # continue from the newest complete checkpoint in the run directory
    max_steps: int | None = None  # stop after this many optimizer steps (the schedule follows the recipe)
    profile_steps: int = 0  # record a torch.profiler trace of this many steps
    save: bool = True  # False: no checkpoints and no final model (benchmarks, smoke tests)

    def to_flags(self) -> list[str]:
        """The command-line flags that hand these options to a worker (from_flags reads them back)."""
        flags = ["--resume" if self.resume else "--no-resume"]
        if self.max_steps is not None:
            flags += ["--max-steps", str(self.max_steps)]
        if self.profile_steps:
            flags += ["--profile", str(self.profile_steps)]
        if not self.save:
            flags.append("--no-save")
        return flags

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser) -> None:
        """Teach a worker's parser the flags to_flags writes."""
        parser.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True)
        parser.add_argument("--max-steps", type=int, default=None)
        parser.add_argument("--profile", type=int, default=0)
        parser.add_argument("--no-save", dest="save", action="store_false")

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> "RunOptions":
        return cls(resume=args.resume, max_steps=args.max_steps, profile_steps=args.profile, save=args.save)

    overwrite: bool = False  # start over in a run directory that holds a run, moving the old one aside


@dataclass(frozen=True)
class ResolvedRun:
    """The recipe as it will run on this machine."""

    name: str
    recipe: Recipe  # offload.zero_stage, checkpointing, train.compile and model.kernels 'auto' made concrete
    run_dir: Path
    recipe_micro_batch: int  # batch.micro_batch with 'auto' resolved by the planner
    micro_batch: int  # the starting micro-batch: at most this rank's share of the global batch
    total_steps: int
    exact_pinned: bool  # whether PyTorch pins host buffers at their size (the planner's pricing)
    plan_peak_reserved_bytes: int | None  # the plan's peak, a reference line in reports (None: not plannable)
    planner_prior: tuple[float, float] | None  # the planned peak as a + b · micro_batch, the batch policy's start
    # The data as built, {recipe key: digest} (memtrain.data.rows.identity): what a resume compares, as it compares the
    # recipe. None: not recorded (a run.json from before memtrain recorded it).
    data_fingerprint: dict[str, str] | None = None
    # The fingerprint of each file each data key names (memtrain.data.rows.identity.data_files): a changed file is
    # refused before the data is tokenised again. None: not recorded (a run.json from before memtrain recorded it).
    data_files: dict[str, list[str]] | None = None

    @property
    def per_rank_batch(self) -> int:
        """This rank's share of the global batch: every process of every node takes an equal one."""
        return self.recipe.batch.global_batch // self.recipe.hardware.world_size

    @property
    def eval_samples(self) -> int:
        """Validation samples per evaluation: independent of the GPU count, of the current micro-batch and of the
        card (see eval_batch_samples)."""
        return self.recipe.train.eval_batches * eval_batch_samples(self.recipe)

    def figures(self) -> dict[str, object]:
        """The plan's figures for this run, as trackers record them beside the recipe."""
        return {
            "micro_batch": self.micro_batch,
            "total_steps": self.total_steps,
            "peak_reserved_bytes": self.plan_peak_reserved_bytes,
            "world_size": self.recipe.hardware.world_size,
        }

    def to_json(self) -> str:
        data = asdict(self)
        data.update(recipe=self.recipe.model_dump(mode="json"), run_dir=str(self.run_dir))
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str) -> "ResolvedRun":
        data = json.loads(text)
        prior = data["planner_prior"]
        return cls(
            **{
                **data,
                "recipe": Recipe.model_validate(data["recipe"]),
                "run_dir": Path(data["run_dir"]),
                "planner_prior": tuple(prior) if prior is not None else None,
            }
        )

    def save(self, directory: Path | None = None) -> Path:
        """Write run.json into the run directory (or `directory`: a node other than the first keeps its own
        copy local, so the run directory holds node 0's, the one every node is compared with)."""
        path = (directory or self.run_dir) / RUN_FILE
        write_atomically(path, self.to_json())
        return path


# Samples per validation batch when batch.micro_batch is 'auto': the size the planner picks depends on the card, and
# the validation set must not (runs on two cards compare). 4 was batch.micro_batch's default before 'auto' was.
AUTO_EVAL_BATCH_SAMPLES = 4


def eval_batch_samples(recipe: Recipe) -> int:
    """The samples that one of train.eval_batches counts: the recipe's micro-batch, or AUTO_EVAL_BATCH_SAMPLES."""
    micro_batch = recipe.batch.micro_batch
    return micro_batch if isinstance(micro_batch, int) else AUTO_EVAL_BATCH_SAMPLES


def max_steps_stop(options: RunOptions, start_step: int) -> int | None:
    """The step --max-steps stops at, counted from where this attempt starts (None: no --max-steps)."""
    return None if options.max_steps is None else start_step + options.max_steps


def max_steps_left(stop_at: int | None, resume_step: int) -> int | None:
    """--max-steps for an attempt that starts again from `resume_step` (after an OOM restart): the same stop step."""
    return None if stop_at is None else max(1, stop_at - resume_step)


def total_steps(recipe: Recipe, n_train_samples: int) -> int:
    """train.steps, or the optimizer steps of train.epochs over the training samples. A warmup longer than the
    run is refused, as the recipe's rules refuse one longer than train.steps (cut to the run's length, the
    schedule's decay would never come)."""
    if recipe.train.steps is not None:
        return recipe.train.steps
    steps = max(1, math.ceil(recipe.train.epochs * n_train_samples / recipe.batch.global_batch))
    if recipe.schedule.warmup_steps > steps:
        raise UserError(
            Problem(
                f"warmup of {recipe.schedule.warmup_steps} steps is longer than the whole run ({steps} steps: "
                f"train.epochs {recipe.train.epochs:g} of {n_train_samples} {recipe.data.item_name} in batches of "
                f"{recipe.batch.global_batch})",
                key="schedule.warmup_steps",
                hint=f"use at most {steps} warmup steps",
            )
        )
    return steps


def resolve_micro_batch_of(recipe: Recipe, exact_pinned: bool, densest_row_samples: int | None = None) -> int:
    """batch.micro_batch, or for 'auto' the planner's largest fit on the recipe's card."""
    if recipe.batch.micro_batch != "auto":
        return recipe.batch.micro_batch
    return resolve_micro_batch(recipe, exact_pinned=exact_pinned, densest_row_samples=densest_row_samples)


def resolve_run(
    recipe: Recipe,
    name: str,
    run_dir: Path,
    n_train_samples: int,
    exact_pinned: bool,
    kernels: KernelSupport | None = None,
    data_fingerprint: dict[str, str] | None = None,
    data_files: dict[str, list[str]] | None = None,
    densest_row_samples: int | None = None,
) -> ResolvedRun:
    """Resolve a validated recipe for this machine: attention and kernels, micro-batch, recomputed layers, steps, the
    plan's figures.

    kernels: what this machine offers Liger's kernels and compilation (default: asked of this machine). Compiled
    layers, then the kernels (which depend on them) are resolved first, so the planner prices the loss and layers
    the run will build. data_fingerprint, data_files: the built data's digests and its files' fingerprints
    (memtrain.data.rows.identity), kept in run.json. densest_row_samples: the built data's (loader.densest_row_samples),
    for every plan made here.
    """
    support = kernels or KernelSupport.current()
    recipe = with_zero_stage(recipe)
    recipe = with_attention(recipe, resolve_attention(recipe, support.varlen))
    recipe = with_train(recipe, compile=resolve_compile(recipe, support.cuda))
    recipe = with_kernels(recipe, resolve_kernels(recipe.model, support, compiled=recipe.train.compile))
    recipe_micro_batch = resolve_micro_batch_of(recipe, exact_pinned, densest_row_samples)
    per_rank_batch = recipe.batch.global_batch // recipe.hardware.world_size
    micro_batch = min(recipe_micro_batch, per_rank_batch)
    resolved = resolve_checkpointing(
        recipe, micro_batch, exact_pinned=exact_pinned, densest_row_samples=densest_row_samples
    )
    # graphs last: they depend on the compiled layers and the recomputed ones, resolved above
    resolved = with_train(resolved, cuda_graphs=resolve_cuda_graphs(resolved, support.cuda))
    return ResolvedRun(
        name=name,
        recipe=resolved,
        run_dir=run_dir,
        recipe_micro_batch=recipe_micro_batch,
        micro_batch=micro_batch,
        total_steps=total_steps(recipe, n_train_samples),
        exact_pinned=exact_pinned,
        plan_peak_reserved_bytes=_planned_peak(resolved, exact_pinned, densest_row_samples),
        planner_prior=_planner_prior(resolved, exact_pinned, densest_row_samples),
        data_fingerprint=data_fingerprint,
        data_files=data_files,
    )


def with_zero_stage(recipe: Recipe) -> Recipe:
    """The recipe with offload.zero_stage 'auto' made the stage it runs with (Recipe.zero_stage), so that each
    checkpoint records the stage its optimizer files were written by, whatever a later memtrain's 'auto' picks."""
    offload = recipe.offload
    if offload.zero_stage == recipe.zero_stage:
        return recipe
    return recipe.model_copy(update={"offload": offload.model_copy(update={"zero_stage": recipe.zero_stage})})


def with_train(recipe: Recipe, **resolved: bool) -> Recipe:
    """The recipe with train settings resolved to true or false (train.compile, train.cuda_graphs); the same object
    when it already says so."""
    if all(getattr(recipe.train, key) is value for key, value in resolved.items()):
        return recipe
    return recipe.model_copy(update={"train": recipe.train.model_copy(update=resolved)})


def with_model_commit(recipe: Recipe) -> Recipe:
    """The recipe with a Hub model's revision made the commit it names now, its files downloaded (the same object for
    a local model or a preset): the run, its workers and its resume then read those weights whatever the branch does
    later, and a resume on a moved branch is refused as a change of model.revision."""
    model = recipe.model
    if not hub_repo(model.path):
        return recipe
    commit = pinned_revision(model.path, model.revision)
    return recipe.model_copy(update={"model": model.model_copy(update={"revision": commit})})


def with_kernels(recipe: Recipe, kernels: str) -> Recipe:
    """The recipe with model.kernels set (the same object when it already says so)."""
    if recipe.model.kernels == kernels:
        return recipe
    return recipe.model_copy(update={"model": recipe.model.model_copy(update={"kernels": kernels})})


def _planned_peak(recipe: Recipe, exact_pinned: bool, densest_row_samples: int | None) -> int | None:
    try:
        return int(
            plan_recipe(recipe, exact_pinned=exact_pinned, densest_row_samples=densest_row_samples).peak_reserved_bytes
        )
    except Exception:  # noqa: BLE001 — the plan is a reference line in reports, never a reason to stop training
        return None


def _planner_prior(recipe: Recipe, exact_pinned: bool, densest_row_samples: int | None) -> tuple[float, float] | None:
    """The planner's peak as a + b · micro_batch (from plans at micro-batch 1 and 2): the batch
    policy's starting line before it has observed any step."""
    try:
        one, two = (
            plan_recipe(
                recipe, micro_batch=size, exact_pinned=exact_pinned, densest_row_samples=densest_row_samples
            ).peak_reserved_bytes
            for size in (1, 2)
        )
    except Exception:  # noqa: BLE001 — without a prior the policy learns from observed peaks
        return None
    slope = max(two - one, 1)
    return float(one - slope), float(slope)
