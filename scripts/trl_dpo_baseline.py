"""The DPO baseline memtrain is measured against: TRL's DPOTrainer + PEFT (+ Liger's DPO loss) on the same pairs.

What a user of TRL writes for the recipe: the same model shape and initialisation seed, the same LoRA adapters
(PEFT, so TRL's reference is the base with the adapters disabled, no second model), beta, learning rate, global
batch and micro-batch in pairs, gradient checkpointing on every layer as the recipe recomputes every layer, bf16,
sequences cut at data.seq_len, and the same memory cap. The pairs are the recipe's preference file (TRL's text
layout, `{"prompt", "chosen", "rejected"}`), tokenised by TRL with the recipe's tokenizer.

Prints one JSON line, the fields scripts/bench_vs_hf.py reads from a baseline: real tokens/s of both sequences of
every pair after the warm-up steps (padding not counted), target (answer) tokens/s, peak GPU memory, host peak RSS,
time from this process's start to the first step.

    python -m scripts.trl_dpo_baseline RECIPE [key=value ...] --steps 8 --warmup 2 --out result.json [--liger]

--liger: TRL's `use_liger_kernel=True`, Liger's fused linear DPO loss (never the full logits). Needs liger-kernel
and a CUDA GPU.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, TrainerCallback
from trl import DPOConfig, DPOTrainer
from trl.trainer.dpo_trainer import DataCollatorForPreference

from memtrain.data.tokens.tokenizer import load_tokenizer
from memtrain.model.build import add_lora
from memtrain.model.config import model_config
from memtrain.plan.planner import resolve_micro_batch
from memtrain.plan.zero import grad_accum_steps
from memtrain.recipe.load import load_recipe
from scripts.baseline_common import DTYPES, cap_to_card, measured, report, run_main, start_alone, trainer_settings


class CountingCollator:
    """TRL's own preference collator, counting the real and answer tokens of each micro-batch it makes."""

    def __init__(self, pad_token_id: int, max_length: int):
        self.collate = DataCollatorForPreference(pad_token_id=pad_token_id, max_length=max_length)
        self.tokens = 0
        self.target_tokens = 0

    def __call__(self, examples):
        batch = self.collate(examples)
        self.tokens += int(batch["attention_mask"].sum())
        self.target_tokens += int(batch["completion_mask"].sum())
        return batch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", type=Path)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--liger", action="store_true")
    args = parser.parse_args()

    loaded = load_recipe(args.recipe, args.overrides)
    recipe = loaded.recipe
    if recipe.train.objective != "dpo" or recipe.model.lora is None:
        raise SystemExit("the DPO baseline runs a LoRA recipe with train.objective: dpo")
    start_alone()
    on_cuda = cap_to_card(recipe)
    micro = recipe.batch.micro_batch if recipe.batch.micro_batch != "auto" else resolve_micro_batch(recipe)
    accum = grad_accum_steps(recipe.batch.global_batch, micro, recipe.hardware.gpus)
    tokenizer = load_tokenizer(recipe.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    pairs = load_dataset("json", data_files=str(recipe.data.train[0].path), split="train")
    dtype = DTYPES[recipe.precision.compute]
    preference = recipe.preference_settings
    counting = CountingCollator(tokenizer.pad_token_id, recipe.data.seq_len)
    with tempfile.TemporaryDirectory() as scratch:
        config = DPOConfig(
            **trainer_settings(recipe, micro_batch=micro, accum=accum, steps=args.steps, output_dir=scratch),
            beta=preference.beta_for("dpo"),
            loss_type=[preference.loss_type],
            max_length=recipe.data.seq_len,
            use_liger_kernel=args.liger,
        )
        torch.manual_seed(recipe.train.seed)
        with torch.device("cuda" if on_cuda else "cpu"):  # a 7B random init on the CPU takes minutes
            model = AutoModelForCausalLM.from_config(model_config(recipe.model), dtype=dtype)
        model.config.use_cache = False
        model = add_lora(model, recipe.model)

        marks: list[float] = []
        counts: list[tuple[int, int]] = []

        class Clock(TrainerCallback):
            def on_step_end(self, *_, **__):
                if on_cuda:
                    torch.cuda.synchronize()
                marks.append(time.time())
                counts.append((counting.tokens, counting.target_tokens))

        trainer = DPOTrainer(
            model=model,
            args=config,
            train_dataset=pairs,
            processing_class=tokenizer,
            data_collator=counting,
            callbacks=[Clock()],
        )
        trainer.train()
    tokens = [b[0] - a[0] for a, b in zip([(0, 0)] + counts, counts)]
    targets = [b[1] - a[1] for a, b in zip([(0, 0)] + counts, counts)]
    result = measured(
        "trl-dpo-liger" if args.liger else "trl-dpo", tokens=tokens, targets=targets, marks=marks, warmup=args.warmup
    )
    report(result, args.out)
    return 0


if __name__ == "__main__":
    run_main(main)
