"""The model card (README.md) a run's model is pushed to the Hub with: written from its recipe and its scores.

The front matter is huggingface_hub's ModelCardData (base_model, library_name, datasets, tags), so the Hub links the
base model and the data; the body says how the model was trained (the recipe's model, data and schedule, the plan's
figures) and how it scored (the last held-out loss and exact match in metrics.jsonl), then the recipe itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from huggingface_hub import ModelCard, ModelCardData

from memtrain import __version__
from memtrain.hub import hub_repo
from memtrain.monitor.metrics import GENERATION_KIND, METRICS_FILE, read_metrics
from memtrain.monitor.perplexity import perplexity_text
from memtrain.recipe.schema import Recipe


def model_card(run_dir: Path, recipe: Recipe, adapter: bool) -> ModelCard:
    """The card of the model RUN_DIR trained (an adapter, or a whole model) from its recipe and metrics."""
    model, data = recipe.model, recipe.data
    base = hub_repo(model.path)
    datasets = sorted({hub_repo(spec.path) for spec in _specs(recipe) if hub_repo(spec.path)})
    card = ModelCardData(
        base_model=base,
        library_name="peft" if adapter else "transformers",
        pipeline_tag="text-generation",
        datasets=datasets or None,
        tags=["memtrain", *(["lora"] if model.lora is not None else []), *(["qlora"] if model.quant_type else [])],
    )
    scores = _scores(Path(run_dir))
    what = "A LoRA adapter" if adapter else "A fine-tuned model"
    on = f"[{base}](https://huggingface.co/{base})" + (f" at commit `{model.revision}`" if model.revision else "")
    if not base:
        on = f"the preset `{model.preset}`" if model.preset else "a local model"
    lines = [
        f"# {recipe.name or Path(run_dir).name}",
        "",
        f"{what} of {on}, trained with memtrain {__version__}.",
        "",
        "## Training",
        "",
        "| | |",
        "|---|---|",
        f"| method | {_method(recipe)} |",
        f"| data | {', '.join(_named(spec) for spec in _specs(recipe)) or f'`{data.train}`'} |",
        f"| sequence length | {data.seq_len} tokens{' (packed)' if data.packing else ''} |",
        f"| batch | {recipe.batch.global_batch} samples per step |",
        f"| length | {f'{recipe.train.steps} steps' if recipe.train.steps else f'{recipe.train.epochs:g} epochs'} |",
        f"| learning rate | {recipe.optimizer.lr:g} ({recipe.schedule.decay} decay, "
        f"{recipe.schedule.warmup_steps} warmup steps) |",
        f"| precision | {recipe.precision.compute} |",
    ]
    lines += _prompting(recipe)
    if scores:
        lines += ["", "## Evaluation", "", "| | |", "|---|---|"]
        lines += [f"| {name} | {value} |" for name, value in scores.items()]
    lines += ["", "## Recipe", "", "```yaml", _recipe_yaml(recipe).rstrip(), "```", ""]
    return ModelCard(f"---\n{card.to_yaml()}\n---\n\n" + "\n".join(lines))


def _prompting(recipe: Recipe) -> list[str]:
    """How to prompt a model the alpaca template trained on instruction records: a record with an input was trained
    on Stanford Alpaca's prompt for a task with an input, which the exported template writes only for a user message
    that carries the input apart (its 'input'); the card says so, with the call."""
    if recipe.data.template != "alpaca" or not any(spec.type == "instruction" for spec in _specs(recipe)):
        return []
    example = '[{"role": "user", "content": "Translate to French.", "input": "Good morning"}]'
    return [
        "",
        "## Prompting",
        "",
        "Trained with the Alpaca prompt. A task with an input was trained with Alpaca's prompt for one (its own "
        "preamble and an `### Input:` block): give the input as the user message's `input`, and "
        "`tokenizer.apply_chat_template` writes that prompt:",
        "",
        "```python",
        f"tokenizer.apply_chat_template({example}, add_generation_prompt=True)",
        "```",
        "",
        "A user message without `input` is prompted as a task without an input.",
    ]


def _specs(recipe: Recipe) -> list:
    specs = []
    for source in (recipe.data.train, recipe.data.validation):
        if source is not None and not isinstance(source, str):
            specs += list(source)
    return specs


def _named(spec) -> str:
    """A dataset as the card names it: its path, and the split and subset it read."""
    parts = [f"{key} {value}" for key, value in (("subset", spec.subset), ("split", spec.split)) if value]
    return f"`{spec.path}`" + (f" ({', '.join(parts)})" if parts else "")


def _method(recipe: Recipe) -> str:
    lora = recipe.model.lora
    if lora is None:
        return "full fine-tune"
    quantized = f", base stored {recipe.model.quant_type}" if recipe.model.quant_type else ""
    return f"LoRA r={lora.r}, alpha={lora.alpha:g}{quantized}"


def _scores(run_dir: Path) -> dict[str, str]:
    """The last held-out loss (and its perplexity) and the last exact match the run recorded."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return {}
    records = read_metrics(path)
    scores = {}
    evals = [r for r in records if r["kind"] == "eval" and isinstance(r.get("loss"), (int, float))]
    if evals:
        last = evals[-1]
        scores["held-out loss"] = (
            f"{last['loss']:.4f} at step {last['step']} (perplexity {perplexity_text(last['loss'])})"
        )
    generated = [r for r in records if r["kind"] == GENERATION_KIND and r.get("total")]
    if generated:
        last = generated[-1]
        seen = last.get("prompts_in_train")  # held-out prompts the training data also holds (older runs: absent)
        also = f", {seen} of them also in training" if seen else ""
        scores["exact match"] = f"{last['exact_match']:.3f} ({last['correct']}/{last['total']} held-out answers{also})"
    return scores


def _recipe_yaml(recipe: Recipe) -> str:
    """The recipe as the run resolved it, without the run's own paths (output and cache directories)."""
    data = json.loads(recipe.model_dump_json(exclude_none=True))
    data.get("train", {}).pop("output_dir", None)
    data.get("data", {}).pop("cache_dir", None)
    return yaml.safe_dump(data, sort_keys=False)
