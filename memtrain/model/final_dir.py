"""`memtrain export RUN_DIR [--merge] [-o DIR]`: the model a finished run produced, as a directory to ship.

A run writes what it trained to RUN_DIR/final at its end (memtrain.train.state.final_model): a PEFT adapter
(adapter_config.json + adapter weights) for LoRA runs, a whole Hugging Face model for full
fine-tunes, with the tokenizer either way; RUN_DIR/recipe.json records the resolved recipe, which
names the base model. Exporting copies `final/` as it is, or, with merge, folds a LoRA adapter
into its base weights (memtrain.model.merge) so that the result loads without PEFT.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from pydantic import ValidationError

from memtrain.dtypes import DTYPES
from memtrain.errors import Problem, UserError
from memtrain.files import directory_atomically, directory_bytes, require_space
from memtrain.hub import hub_repo, model_dir
from memtrain.model.merge import merge_adapter
from memtrain.recipe.schema import Recipe


def export_run(run_dir: Path, merge: bool, out_dir: Path | None = None, dtype: torch.dtype | None = None) -> Path:
    """Export the run's final model; returns where it is.

    merge: fold a LoRA adapter into its base weights (a full fine-tune is already whole and is copied).
    out_dir: where to write (must not exist, or be empty); default RUN_DIR/merged with merge, and
    without it RUN_DIR/final itself (nothing to write).
    dtype: of the merged weights; default the run's precision.compute.
    Raises UserError for a run directory without a finished model, or a base that cannot be found.
    """
    run_dir = Path(run_dir)
    final = final_model_dir(run_dir)
    recipe = run_recipe(run_dir)
    is_adapter = (final / "adapter_config.json").is_file()
    if out_dir is None:
        if not merge:
            return final
        out_dir = run_dir / "merged"
    out_dir = Path(out_dir)
    if merge and is_adapter:
        base_dir = base_model_dir(recipe, run_dir)
        return merge_adapter(
            final,
            base_dir,
            out_dir,
            dtype or DTYPES[recipe.precision.compute],
            quantize=recipe.model.quantize,
            tokenizer_dir=final,
        )
    with directory_atomically(out_dir) as tmp:
        require_space(out_dir, directory_bytes(final), "the model")
        shutil.copytree(final, tmp, dirs_exist_ok=True)
    return out_dir


def final_model_dir(run_dir: Path) -> Path:
    if not run_dir.is_dir():
        raise UserError(
            Problem(
                f"there is no run directory '{run_dir}'",
                hint="give the directory `memtrain run` wrote (train.output_dir, runs/NAME by default)",
            )
        )
    final = run_dir / "final"
    if not ((final / "adapter_config.json").is_file() or (final / "config.json").is_file()):
        checkpoints = sorted(p.name for p in run_dir.glob("checkpoints/step-*") if p.is_dir())
        state = (
            f"it has checkpoints ({', '.join(checkpoints[-2:])}) but the run did not finish"
            if checkpoints
            else "the run did not finish, or this is not a run directory"
        )
        hint = "resume the run with `memtrain run RECIPE` until it ends; it writes final/ at the end"
        last = checkpoints[-1].removeprefix("step-") if checkpoints else ""
        if last.isdigit():  # an interrupted run can end where it stopped (users export a checkpoint)
            hint += (
                f", or end it at its last checkpoint now: `memtrain run RECIPE train.steps={int(last)}` writes "
                "final/ from it without training more"
            )
        raise UserError(Problem(f"'{run_dir}' has no final model (final/ with a model or adapter): {state}", hint=hint))
    return final


def run_recipe(run_dir: Path) -> Recipe:
    path = run_dir / "recipe.json"
    try:
        return Recipe.model_validate_json(path.read_text())
    except (OSError, ValidationError, ValueError) as error:
        raise UserError(
            Problem(
                f"cannot read the run's recipe {path}: {str(error).splitlines()[0]}",
                hint="the run directory must be one `memtrain run` wrote (it records recipe.json)",
            )
        ) from None


def base_model_dir(recipe: Recipe, run_dir: Path) -> Path:
    model = recipe.model
    if model.preset:
        raise UserError(
            Problem(
                f"the run trained LoRA on the preset '{model.preset}', whose base weights are random and were never "
                "saved, so there is nothing to merge the adapter into",
                key="model.preset",
                hint=f"export without --merge (the adapter in {run_dir / 'final'}), or train on a model directory "
                "(model.path)",
            )
        )
    if hub_repo(model.path):  # the commit the run trained on (run.json's recipe pins it), from the cache
        return model_dir(model.path, model.revision)
    base_dir = Path(model.path).expanduser()
    if not (base_dir / "config.json").is_file():
        raise UserError(
            Problem(
                f"the base model '{model.path}' recorded in {run_dir / 'recipe.json'} is not a model directory "
                "from here",
                key="model.path",
                hint="run the export from the directory the run started in (relative paths are relative to it), "
                "or merge with memtrain.model.merge.merge_adapter(adapter_dir, base_dir, out_dir)",
            )
        )
    return base_dir
