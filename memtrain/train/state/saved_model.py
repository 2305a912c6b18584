"""A run's trained model loaded for use (`memtrain chat`, `memtrain eval`): its final model, or a checkpoint.

- RUN_DIR/final: a whole Hugging Face model, or a PEFT adapter loaded onto the run's base (model.path: a local
  directory or the Hub commit the run pinned), with the tokenizer saved beside it.
- RUN_DIR/checkpoints/step-N: the model rebuilt from the recipe (memtrain.model.build, LoRA included) and given the
  weights DeepSpeed saved: the module's own under ZeRO 0-2 (what the run computed with, as final/ exports them),
  DeepSpeed's fp32 reconstruction of the partitions under ZeRO-3. The tokenizer is final/'s when the run finished,
  else rebuilt as training built it (the template's markers added).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from memtrain.data.render.templates import ensure_template_tokens
from memtrain.data.tokens.tokenizer import load_tokenizer
from memtrain.dtypes import DTYPES
from memtrain.errors import Problem, UserError
from memtrain.model.build import build_model
from memtrain.model.final_dir import base_model_dir, final_model_dir, run_recipe
from memtrain.model.merge import load_base
from memtrain.model.peft_quiet import peft_quietly
from memtrain.recipe.schema import Recipe
from memtrain.train.resolve import RUN_FILE, ResolvedRun
from memtrain.train.state.checkpoint import DS_TAG, checkpoint_dir, checkpoint_problem, complete_checkpoints
from memtrain.train.state.frozen_base import (
    base_key,
    base_problem,
    fingerprint,
    load_without_base,
    read_record,
)

_MODEL_STATES = "mp_rank_00_model_states.pt"  # DeepSpeed's module state (rank 0), beside its optimizer states
_WRAPPER_PREFIX = "model."  # the engine's module is memtrain's TrainableLM, the model inside it under `model`


@dataclass(frozen=True)
class SavedModel:
    model: torch.nn.Module  # in eval mode, on the device asked for
    tokenizer: PreTrainedTokenizerBase
    recipe: Recipe  # the run's resolved recipe (run.json's, recipe.json's for a run without one)
    source: Path  # final/ or the checkpoint directory


def run_settings_recipe(run_dir: Path) -> Recipe:
    """The recipe as the run resolved it: run.json's, or recipe.json's for a run from before run.json."""
    path = run_dir / RUN_FILE
    if not path.is_file():
        return run_recipe(run_dir)
    try:
        return ResolvedRun.from_json(path.read_text()).recipe
    except (OSError, ValueError, TypeError, KeyError, json.JSONDecodeError) as error:
        raise UserError(
            Problem(
                f"cannot read the run's settings {path}: {str(error).splitlines()[0]}",
                hint="the run directory must be one `memtrain run` wrote",
            )
        ) from None


def load_saved_model(
    run_dir: Path, device: torch.device, dtype: torch.dtype | None = None, checkpoint: str | None = None
) -> SavedModel:
    """The run's final model, or with `checkpoint` (a step number, or a checkpoint directory) that checkpoint's.
    dtype: default the run's precision.compute on a GPU, fp32 on the CPU (bf16 matmuls are slow there, and using a
    model needs no memory saving on it), as `memtrain eval` scores."""
    run_dir = Path(run_dir)
    if checkpoint is None:
        final = final_model_dir(run_dir)
    else:
        if not run_dir.is_dir():
            final_model_dir(run_dir)  # says there is no run directory
        directory = checkpoint_path(run_dir, checkpoint)
    recipe = run_settings_recipe(run_dir)
    if dtype is None:
        dtype = DTYPES[recipe.precision.compute] if device.type == "cuda" else torch.float32
    if checkpoint is None:
        model = final_model(final, recipe, run_dir, dtype)
        return SavedModel(model.to(device).eval(), final_tokenizer(final), recipe, final)
    final = run_dir / "final"
    tokenizer = final_tokenizer(final) if (final / "tokenizer_config.json").is_file() else training_tokenizer(recipe)
    model = checkpoint_model(directory, recipe, tokenizer, dtype)
    return SavedModel(model.to(device).eval(), tokenizer, recipe, directory)


def final_tokenizer(final: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved with the model (with any tokens the run added), with a pad token as training had."""
    tokenizer = AutoTokenizer.from_pretrained(final, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def training_tokenizer(recipe: Recipe) -> PreTrainedTokenizerBase:
    """The tokenizer as training built it: the recipe's, with the chat template's markers added."""
    tokenizer = load_tokenizer(recipe.model)
    ensure_template_tokens(recipe.data, tokenizer)
    return tokenizer


def final_model(final: Path, recipe: Recipe, run_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    """final/ as a model: whole, or its adapter on the base the run trained on."""
    if not (final / "adapter_config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(final, dtype=dtype, local_files_only=True)
    if recipe.model.preset:
        raise UserError(
            Problem(
                f"the run trained a LoRA adapter on the preset '{recipe.model.preset}', whose random base weights were "
                "never saved, so the adapter has nothing to run on",
                key="model.preset",
                hint="use one of the run's checkpoints (--checkpoint N: they hold the base weights too), or train "
                "LoRA on a model (model.path)",
            )
        )
    from peft import PeftModel  # noqa: PLC0415 — optional until an adapter is loaded

    base = load_base(base_model_dir(recipe, run_dir), dtype, recipe.model.quantize)
    with peft_quietly():
        return PeftModel.from_pretrained(base, final, is_trainable=False)


def checkpoint_path(run_dir: Path, checkpoint: str) -> Path:
    """A checkpoint named by its step (20) or its directory; UserError listing the run's when there is none."""
    directory = checkpoint_dir(run_dir, int(checkpoint)) if checkpoint.isdigit() else Path(checkpoint)
    steps = [p.name.removeprefix("step-").lstrip("0") or "0" for p in complete_checkpoints(run_dir)]
    if (directory / DS_TAG / _MODEL_STATES).is_file():
        problem = checkpoint_problem(directory)  # its files are those it was saved with, not a damaged copy
        if problem is None:
            return directory
        raise UserError(
            Problem(
                f"the checkpoint {directory} does not verify: {problem}",
                hint=f"give another of the run's steps ({', '.join(steps)})",
            )
        )
    raise UserError(
        Problem(
            f"there is no complete checkpoint '{checkpoint}' in {run_dir}",
            hint=f"give one of its steps ({', '.join(steps)})" if steps else "the run has saved no checkpoint yet",
        )
    )


def checkpoint_model(
    directory: Path, recipe: Recipe, tokenizer: PreTrainedTokenizerBase, dtype: torch.dtype
) -> torch.nn.Module:
    """The recipe's model (LoRA included) with the checkpoint's weights, on the CPU in `dtype`."""
    # the embeddings grown to the tokenizer, as training grew them for a template's markers (model/build.py)
    cpu = torch.device("cpu")
    model = build_model(recipe.model, recipe.precision.storage, cpu, seed=recipe.train.seed, vocab_size=len(tokenizer))
    state = checkpoint_state_dict(directory, recipe)
    recorded = read_record(directory)
    if recorded is None:
        model.load_state_dict(state, strict=True)
        return model.to(dtype)
    # saved without its frozen base (frozen_base.py): the base built again must be the one it was trained over,
    # and the checkpoint must hold every other tensor; the record names the tensors as the wrapper does
    recorded = {**recorded, "tensors": {k.removeprefix(_WRAPPER_PREFIX): v for k, v in recorded["tensors"].items()}}
    problem = base_problem(recorded, fingerprint(model), directory, base_key(recipe.model))
    if problem is None:
        problem = load_without_base(state, model, directory)
    if problem is not None:
        raise UserError(problem)
    return model.to(dtype)


def checkpoint_state_dict(directory: Path, recipe: Recipe) -> dict[str, torch.Tensor]:
    """The model's weights in a checkpoint, named as the model inside memtrain's wrapper names them."""
    if recipe.zero_stage == 3:  # partitioned: DeepSpeed puts the fp32 partitions back together
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: PLC0415 — ZeRO-3

        state = get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=DS_TAG)
    else:
        state = torch.load(directory / DS_TAG / _MODEL_STATES, map_location="cpu", weights_only=False)["module"]
    return {name.removeprefix(_WRAPPER_PREFIX): tensor for name, tensor in state.items()}
