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
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, TrainerCallback
from trl import DPOConfig, DPOTrainer
from trl.trainer.dpo_trainer import DataCollatorForPreference

from memtrain.configs import gpu_profile
from memtrain.data.tokens.tokenizer import load_tokenizer
from memtrain.errors import UserError
from memtrain.model.build import add_lora
from memtrain.model.config import model_config
from memtrain.plan.planner import resolve_micro_batch
from memtrain.plan.zero import grad_accum_steps
from memtrain.recipe.load import load_recipe
from memtrain.train.runtime.distributed import free_port
from scripts.hf_baseline import per_second


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
    if "RANK" not in os.environ:  # one process, no launcher
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    on_cuda = torch.cuda.is_available()
    if on_cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        cap = min(gpu_profile(recipe.hardware.gpu).memory_bytes, total)
        torch.cuda.set_per_process_memory_fraction(cap / total, 0)
    micro = recipe.batch.micro_batch if recipe.batch.micro_batch != "auto" else resolve_micro_batch(recipe)
    accum = grad_accum_steps(recipe.batch.global_batch, micro, recipe.hardware.gpus)
    tokenizer = load_tokenizer(recipe.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    pairs = load_dataset("json", data_files=str(recipe.data.train[0].path), split="train")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[recipe.precision.compute]
    preference = recipe.preference_settings
    counting = CountingCollator(tokenizer.pad_token_id, recipe.data.seq_len)
    with tempfile.TemporaryDirectory() as scratch:
        config = DPOConfig(
            output_dir=scratch,
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=accum,
            max_steps=args.steps,
            learning_rate=recipe.optimizer.lr,
            weight_decay=recipe.optimizer.weight_decay,
            warmup_steps=recipe.schedule.warmup_steps,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            logging_steps=10**9,
            save_strategy="no",
            report_to=[],
            seed=recipe.train.seed,
            dataloader_num_workers=0,
            gradient_checkpointing=recipe.checkpointing.strategy != "none",
            gradient_checkpointing_kwargs={"use_reentrant": False},
            use_cpu=not on_cuda,
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
    result = {
        "baseline": "trl-dpo-liger" if args.liger else "trl-dpo",
        "tokens_per_s": per_second(tokens, marks, args.warmup),
        "target_tokens_per_s": per_second(targets, marks, args.warmup),
        "steps": len(marks),
        "time_to_first_step_s": (marks[0] - psutil.Process().create_time()) if marks else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if on_cuda else 0.0,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if on_cuda else 0.0,
        "host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30,
    }
    args.out.write_text(json.dumps(result))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        raise SystemExit(main())
    except UserError as error:  # a recipe or data problem: the message, file:line and fix, not a traceback
        print(error, file=sys.stderr)
        raise SystemExit(error.exit_code) from None
