"""A finished run scored again: held-out loss and exact match of greedy answers, from RUN_DIR alone.
A preference run's held-out pairs are scored too: their reward accuracy and margin against the run's reference.

    result = evaluate_run(run_dir, limit=100, keep_samples=5)

The model is RUN_DIR/final (a whole Hugging Face model, or a PEFT adapter on the run's model.path), the
tokenizer the one saved beside it, the recipe RUN_DIR/run.json's (recipe.json where there is none). The loss is
the run's own evaluation (memtrain.train.eval.validation_loss.evaluate) over the same validation samples; exact match is
memtrain.train.eval.generation over the recipe's held-out conversations. Text-only data has no answers: the
result then has a loss and a note saying why there is no exact match.

A preference run (train.objective dpo, orpo, simpo, kto): the loss is its preference loss over the same held-out
pairs, through memtrain.model.preference.PreferenceLM, with its rewards. The reference is the run's: under LoRA the
base with the adapter disabled; a precomputed one read from beside the token cache where the run stored it, else
computed again from the run's model.path; none for ORPO and SimPO.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from memtrain.data.rows.dataset import build_validation
from memtrain.data.rows.identity import TRAIN_KEY, VALIDATION_KEY, data_files
from memtrain.data.rows.loader import BatchLoader
from memtrain.data.rows.prompts import has_answers, held_out_prompts
from memtrain.dtypes import DTYPES
from memtrain.errors import Problem, UserError
from memtrain.model.final_dir import base_model_dir, final_model_dir, run_recipe
from memtrain.model.merge import load_base
from memtrain.model.peft_quiet import peft_quietly
from memtrain.model.preference import PreferenceLM, preference_metrics, reference_of
from memtrain.model.preference_loss import PreferenceSettings
from memtrain.model.wrapper import TrainableLM
from memtrain.monitor.perplexity import perplexity
from memtrain.recipe.schema import Recipe
from memtrain.train.eval.generation import (
    SAMPLES_KEPT,
    GenerationScore,
    generation_eval,
    stop_token_ids,
)
from memtrain.train.eval.validation_loss import evaluate
from memtrain.train.resolve import RUN_FILE, ResolvedRun, eval_batch_samples
from memtrain.train.runtime.distributed import Place
from memtrain.train.state.reference import compute_reference, reference_path
from memtrain.train.state.resume import named_files, recorded_data_files

TEXT_ONLY_NOTE = (
    "the run's held-out data is text, which has no answers to check: exact match needs completion, "
    "instruction or chat data; the loss is reported alone"
)

TEXT_PAIRS_NOTE = (
    "the run's held-out pairs are plain text, which has no conversation to ask: exact match needs conversational "
    "pairs; the loss and the rewards are reported alone"
)


@dataclass(frozen=True)
class RunEvaluation:
    run_dir: Path
    loss: float
    validation_rows: int  # the rows of seq_len tokens the loss is over (packed: several samples each)
    validation_target_tokens: int  # the positions the loss is the mean over
    generation: GenerationScore | None  # None for text-only data (see note)
    note: str | None = None
    pairs: dict[str, float] | None = None  # a preference run's held-out rewards (preference_metrics); None for SFT

    @property
    def perplexity(self) -> float | None:
        """exp(loss); None (JSON null) past the cap of monitor/perplexity.py, or for a preference loss (no token
        NLL)."""
        return perplexity(self.loss) if self.pairs is None else None

    def as_json(self) -> dict:
        """loss, perplexity, validation rows and target tokens, exact_match, correct, total, skipped, by_task,
        prompts_in_train, answers_in_train, samples, note: the same keys for every run (the generation's are null for
        text-only data)."""
        out = {
            "run_dir": str(self.run_dir),
            "loss": self.loss,
            "perplexity": self.perplexity,
            "validation_rows": self.validation_rows,
            "validation_target_tokens": self.validation_target_tokens,
            "exact_match": None,
            "correct": None,
            "total": None,
            "skipped": None,
            "by_task": None,
            "prompts_in_train": None,
            "answers_in_train": None,
            "samples": [],
            "note": self.note,
        }
        if self.generation is not None:
            out.update(self.generation.as_record())
        if self.pairs is not None:  # a preference run: the held-out pairs' rewards (TRL's names without the slash)
            out.update(self.pairs)
        return out


def evaluate_run(
    run_dir: Path,
    *,
    limit: int | None = None,
    keep_samples: int = SAMPLES_KEPT,
    device: torch.device | None = None,
    on_answers: Callable[[int, int], None] | None = None,
) -> RunEvaluation:
    """Score RUN_DIR's final model (module doc). `limit`: held-out conversations to generate for (None: all).
    on_answers(answered, all): after each batch of greedy answers, for a progress bar.

    Raises UserError for a missing run directory, a run without a final model, an unreadable recipe, or a
    LoRA run whose base weights cannot be found.
    """
    run_dir = Path(run_dir)
    final = final_model_dir(run_dir)
    recipe, eval_samples, micro_batch = _run_settings(run_dir)
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # bf16 matmuls are slow on a CPU, and scoring needs no memory saving there
    dtype = DTYPES[recipe.precision.compute] if device.type == "cuda" else torch.float32
    _refuse_changed_held_out(run_dir, recipe)
    tokenizer = _tokenizer(final)
    model = _model(final, recipe, run_dir, dtype).to(device)
    val_set = build_validation(recipe.data, tokenizer, recipe.train.seed)
    samples = min(eval_samples, len(val_set))
    targets = val_set.targets(range(samples))
    pairs = None
    if recipe.train.objective == "sft":
        module = TrainableLM(model, recipe.precision)
    else:
        module = PreferenceLM(model, recipe.precision, PreferenceSettings.of(recipe), reference_of(recipe))
        if module.reference == "precomputed":
            val_set = val_set.with_reference(_stored_reference(recipe, run_dir, val_set, micro_batch, device, dtype))
    with BatchLoader(val_set, device, trim=recipe.data.groups_by_length) as loader:
        loss = evaluate(module, loader, val_set, samples=samples, micro_batch=micro_batch, place=Place.single(device))
    if isinstance(module, PreferenceLM):
        pairs = preference_metrics(module.take_metric_sums())
    if not has_answers(recipe.data):
        return RunEvaluation(run_dir, loss, samples, targets, None, TEXT_ONLY_NOTE, pairs)
    prompts, skipped = held_out_prompts(recipe.data, tokenizer, limit=limit)
    if recipe.data.holds_pairs and not prompts and not skipped:  # text pairs: no conversation to ask
        return RunEvaluation(run_dir, loss, samples, targets, None, TEXT_PAIRS_NOTE, pairs)
    score = generation_eval(
        model,
        tokenizer,
        prompts,
        stop_token_ids(recipe.data.template, tokenizer),
        skipped=skipped,
        keep_samples=keep_samples,
        on_batch=on_answers,
    )
    return RunEvaluation(run_dir, loss, samples, targets, score, pairs=pairs)


def _stored_reference(recipe: Recipe, run_dir: Path, val_set, micro_batch: int, device, dtype) -> object:
    """The held-out pairs' precomputed reference log-probabilities: as the run stored them beside the token cache,
    else computed again from the run's initial model (model.path; a preset's random start was never saved)."""
    path = reference_path(recipe, val_set)
    if path.is_file():
        return np.load(path)
    base = load_base(base_model_dir(recipe, run_dir), dtype, recipe.model.quantize).to(device)
    reference = PreferenceLM(base, recipe.precision, PreferenceSettings.of(recipe), "precomputed")
    with BatchLoader(val_set, device, trim=recipe.data.groups_by_length) as loader:
        return compute_reference(reference, loader, val_set, micro_batch=micro_batch, place=Place.single(device))


def _run_settings(run_dir: Path) -> tuple[Recipe, int, int]:
    """(recipe, validation samples per evaluation, micro-batch) as the run resolved them (run.json)."""
    path = run_dir / RUN_FILE
    if not path.is_file():  # a run from before run.json: the recipe and its own numbers
        recipe = run_recipe(run_dir)
        micro_batch = eval_batch_samples(recipe)
        return recipe, recipe.train.eval_batches * micro_batch, micro_batch
    try:
        run = ResolvedRun.from_json(path.read_text())
    except (OSError, ValueError, TypeError, KeyError, json.JSONDecodeError) as error:
        raise UserError(
            Problem(
                f"cannot read the run's settings {path}: {str(error).splitlines()[0]}",
                hint="the run directory must be one `memtrain run` wrote",
            )
        ) from None
    return run.recipe, run.eval_samples, run.micro_batch


def _refuse_changed_held_out(run_dir: Path, recipe: Recipe) -> None:
    """The held-out records are found again from the files the run read: its validation files, or the tail of its
    training files. Files with other bytes than the run recorded would be scored as held out when they are not
    (a shuffled training file puts trained records in the tail, and the score would rise without a word)."""
    key = TRAIN_KEY if recipe.data.validation is None else VALIDATION_KEY
    recorded = (recorded_data_files(run_dir) or {}).get(key)
    if recorded is None:
        return  # a run.json written before data files were recorded: nothing to compare with
    if data_files(recipe.data, keys=(key,)).get(key) != recorded:
        raise UserError(
            Problem(
                f"{named_files(key, recipe)} no longer holds the bytes the run was trained on, so the records it holds "
                "out are not the ones the run held out",
                key=key,
                hint="put back the data files the run was trained on to score it",
            )
        )


def _tokenizer(final: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved with the model (with any tokens the run added), with a pad token as training had."""
    tokenizer = AutoTokenizer.from_pretrained(final, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _model(final: Path, recipe: Recipe, run_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    if not (final / "adapter_config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(final, dtype=dtype, local_files_only=True)
    if recipe.model.preset:
        raise UserError(
            Problem(
                f"the run trained a LoRA adapter on the preset '{recipe.model.preset}', whose random base weights were "
                "never saved, so the adapter has nothing to be scored on",
                key="model.preset",
                hint="train LoRA on a model directory (model.path), or fine-tune the preset in full",
            )
        )
    from peft import PeftModel  # noqa: PLC0415 — optional until an adapter is scored

    base = load_base(base_model_dir(recipe, run_dir), dtype, recipe.model.quantize)
    with peft_quietly():
        return PeftModel.from_pretrained(base, final, is_trainable=False)
