"""The baseline chat users pick: TRL's SFTTrainer (+ PEFT LoRA, + Liger with --liger) on memtrain's rows.

Same model shape and initialisation seed, LoRA section, precision, checkpointing (the Trainer's gradient
checkpointing, every layer), global batch and memory cap as the recipe. Same targets: memtrain's data build
(train/setup.build_data) renders and tokenises the recipe's data with its template and masks; every sample of its
rows goes to TRL as `input_ids` and `labels` (-100 where memtrain trains nothing: prompts, system turns, each
sample's first token), a dataset TRL takes as already processed and whose labels it uses as they are. TRL packs
them itself (`packing_strategy="bfd"`, padding-free: one flattened sequence per micro-batch with the samples'
position ids, in rows of data.seq_len) when the recipe packs, or pads each micro-batch to its longest sample when
it does not. The attention is sdpa, what TRL gives without the flash-attn package: transformers keeps TRL's packed
samples apart with a block-diagonal mask built from the restarting position ids. No DeepSpeed: a LoRA fine-tune on
one card, as TRL's docs run it.

Prints one JSON line as scripts/hf_baseline.py does (tokens_per_s: real input tokens, padding left out;
target_tokens_per_s: the loss's; after the warm-up steps; peak GPU memory; host peak RSS) and appends one row to
--csv (benchmarks/trl_baseline.csv by default) with the baseline (trl, or trl-liger), machine, date and command.
Runs on the CPU too, for its test (tests/scripts/test_trl_baseline.py).

    python scripts/trl_baseline.py RECIPE [key=value ...] --steps 12 --warmup 3 --out result.json [--liger]

Needs TRL: pip install 'memtrain[trl]' (and liger-kernel with a CUDA GPU for --liger).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback
from trl import SFTConfig, SFTTrainer

from memtrain.data.rows.row_set import SampleRows
from memtrain.errors import Problem, UserError
from memtrain.labels import IGNORE_INDEX
from memtrain.model.build import lora_config
from memtrain.model.config import model_config
from memtrain.plan.planner import resolve_micro_batch
from memtrain.plan.zero import grad_accum_steps
from memtrain.recipe.load import load_recipe
from memtrain.recipe.schema import Recipe
from memtrain.train.setup import build_data
from scripts.baseline_common import DTYPES, cap_to_card, measured, report, run_main, trainer_settings

COLUMNS = (
    "recipe",
    "baseline",
    "packing",
    "micro_batch",
    "seq_len",
    "tokens_per_s",
    "target_tokens_per_s",
    "padding_share",
    "peak_reserved_gib",
    "peak_allocated_gib",
    "host_peak_rss_gib",
    "time_to_first_step_s",
    "machine",
    "date",
    "command",
)


def samples_of(rows: SampleRows) -> dict[str, list[list[int]]]:
    """Every sample of memtrain's rows on its own: its tokens and its labels as memtrain trains them."""
    input_ids, labels = [], []
    lengths = rows.samples.length
    for index in range(len(rows)):
        item, at = rows[index], 0
        for sample in rows.row(index):
            length = int(lengths[sample])
            input_ids.append(item["input_ids"][at : at + length].tolist())
            labels.append(item["labels"][at : at + length].tolist())
            at += length
    return {"input_ids": input_ids, "labels": labels}


class Counts:
    """Real input tokens, target tokens and positions computed of every micro-batch the model runs, kept on the
    device and read once a step (a forward pre-hook: whatever TRL's collator made of the batch)."""

    def __init__(self, model: torch.nn.Module):
        self.tokens = self.targets = self.positions = 0
        self._pending: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self.handle = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs):
        input_ids, labels, mask = kwargs.get("input_ids"), kwargs.get("labels"), kwargs.get("attention_mask")
        if input_ids is None or labels is None:
            return
        real = mask.sum() if mask is not None else torch.tensor(input_ids.numel(), device=input_ids.device)
        # the padding-free collator pads the flattened sequence to pad_to_multiple_of with labels -100 only
        self._pending.append((real, (labels != IGNORE_INDEX).sum(), input_ids.numel()))

    def take(self) -> tuple[int, int, int]:
        """(tokens, targets, positions) since the last call."""
        pending, self._pending = self._pending, []
        return (
            int(sum(int(real) for real, _, _ in pending)),
            int(sum(int(targets) for _, targets, _ in pending)),
            sum(positions for _, _, positions in pending),
        )


def check_chat(recipe: Recipe, rows) -> None:
    if not isinstance(rows, SampleRows):
        raise UserError(
            Problem(
                "the TRL baseline trains instruction and chat samples; this recipe's data is plain text windows",
                key="data.train",
                hint="give a recipe whose data.train lists chat or instruction datasets (scripts/hf_baseline.py "
                "measures text)",
            )
        )
    if recipe.model.lora is None:
        raise UserError(
            Problem(
                "the TRL baseline is a LoRA fine-tune on one card (no DeepSpeed); this recipe trains every weight",
                key="model.lora",
                hint="add a model.lora section (e.g. model.lora.r=16)",
            )
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", type=Path)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--csv", type=Path, default=Path("benchmarks/trl_baseline.csv"))
    parser.add_argument("--liger", action="store_true", help="TRL with use_liger_kernel (baseline trl-liger)")
    args = parser.parse_args()
    baseline = "trl-liger" if args.liger else "trl"

    loaded = load_recipe(args.recipe, args.overrides)
    recipe = loaded.recipe
    on_cuda = cap_to_card(recipe)
    with loaded.sources.located():  # problems at the recipe's file:line
        data = build_data(recipe)
    rows = data.train_set
    check_chat(recipe, rows)
    micro = recipe.batch.micro_batch if recipe.batch.micro_batch != "auto" else resolve_micro_batch(recipe)
    accum = grad_accum_steps(recipe.batch.global_batch, micro, recipe.hardware.gpus)
    # sdpa, not memtrain's choice: TRL's model is built by transformers as a TRL user builds it
    config = model_config(recipe.model.model_copy(update={"attn_implementation": "sdpa"}))
    dtype = DTYPES[recipe.precision.compute]
    dataset = Dataset.from_dict(samples_of(rows))

    torch.manual_seed(recipe.train.seed)
    with torch.device("cuda" if on_cuda else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if data.model_vocab_size is not None:  # the template's markers were added to the tokenizer
            model.resize_token_embeddings(data.model_vocab_size)
    model.config.use_cache = False
    counts = Counts(model)
    marks: list[float] = []
    per_step: list[tuple[int, int, int]] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            if on_cuda:
                torch.cuda.synchronize()
            marks.append(time.time())
            per_step.append(counts.take())

    with tempfile.TemporaryDirectory() as scratch:
        training = SFTConfig(
            **trainer_settings(recipe, micro_batch=micro, accum=accum, steps=args.steps, output_dir=scratch),
            use_liger_kernel=args.liger,
            max_length=recipe.data.seq_len,
            packing=recipe.data.packing,
            packing_strategy="bfd",
            dataset_num_proc=None,
        )
        trainer = SFTTrainer(
            model=model,
            args=training,
            train_dataset=dataset,
            processing_class=data.tokenizer,
            peft_config=lora_config(recipe.model.lora),
            callbacks=[Clock()],
        )
        trainer.train()
    counts.handle.remove()
    tokens = [step[0] for step in per_step]
    targets = [step[1] for step in per_step]
    positions = sum(step[2] for step in per_step)
    result = measured(
        baseline,
        tokens=tokens,
        targets=targets,
        marks=marks,
        warmup=args.warmup,
        padding_share=1 - sum(tokens) / positions if positions else None,
    )
    report(result, args.out)
    write_row(args, recipe, micro, result)
    return 0


def write_row(args: argparse.Namespace, recipe: Recipe, micro: int, result: dict) -> None:
    def number(value, pattern: str) -> str:
        return pattern.format(value) if value is not None else ""

    row = {
        "recipe": " ".join([str(args.recipe), *args.overrides]),
        "baseline": result["baseline"],
        "packing": recipe.data.packing,
        "micro_batch": micro,
        "seq_len": recipe.data.seq_len,
        "tokens_per_s": number(result["tokens_per_s"], "{:.0f}"),
        "target_tokens_per_s": number(result["target_tokens_per_s"], "{:.0f}"),
        "padding_share": number(result["padding_share"], "{:.3f}"),
        "peak_reserved_gib": f"{result['peak_reserved_gib']:.2f}",
        "peak_allocated_gib": f"{result['peak_allocated_gib']:.2f}",
        "host_peak_rss_gib": f"{result['host_peak_rss_gib']:.1f}",
        "time_to_first_step_s": number(result["time_to_first_step_s"], "{:.0f}"),
        "machine": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "date": datetime.date.today().isoformat(),
        "command": "python " + shlex.join(["scripts/trl_baseline.py", *sys.argv[1:]]),
    }
    new_file = not args.csv.exists()
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        if new_file:
            writer.writeheader()
        writer.writerow(row)


if __name__ == "__main__":
    run_main(main)
