"""The alternative memtrain is measured against: Hugging Face Trainer + DeepSpeed on the same recipe.

Same model shape and initialisation seed, same tokenised windows (memtrain's data pipeline), same
global batch, precision, checkpointing (HF's gradient checkpointing, every layer), LoRA and ZeRO
offload tiers (memtrain's compiled DeepSpeed config, handed to the Trainer as Axolotl and
LLaMA-Factory do), same memory cap. Prints one JSON line: tokens/s after the warm-up steps, peak
GPU memory, host peak RSS. Used by scripts/bench_vs_hf.py; runs on the CPU too (for its test).

    python scripts/hf_baseline.py RECIPE [key=value ...] --steps 12 --warmup 3 --out result.json [--baseline hf-liger]

--baseline hf-liger: the same Trainer with `use_liger_kernel=True` (transformers applies Liger's fused linear
cross-entropy, RMSNorm, SwiGLU and RoPE to the model instance, through the PEFT wrapper, when training starts):
the strongest baseline a user would pick without writing code. Needs liger-kernel and a CUDA GPU.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def hf_deepspeed_config(compiled: dict) -> dict:
    """memtrain's config minus what the Trainer drives itself (accumulation, schedule)."""
    config = {k: v for k, v in compiled.items() if k != "steps_per_print"}
    config["steps_per_print"] = 10**9
    return config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", type=Path)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--baseline", choices=("hf", "hf-liger"), default="hf")
    args = parser.parse_args()

    from transformers import Trainer, TrainerCallback, TrainingArguments

    from memtrain.configs import gpu_profile
    from memtrain.data.dataset import build_datasets
    from memtrain.data.tokenizer import load_tokenizer
    from memtrain.model.build import add_lora
    from memtrain.ds_config.compiler import ds_config
    from memtrain.model.config import model_config
    from memtrain.plan.zero import grad_accum_steps
    from memtrain.recipe.load import load_recipe

    from memtrain.train.distributed import free_port

    recipe = load_recipe(args.recipe, args.overrides).recipe
    if "RANK" not in os.environ:  # one process, no launcher: what DeepSpeed needs to start alone
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    on_cuda = torch.cuda.is_available()
    if on_cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        cap = min(gpu_profile(recipe.hardware.gpu).memory_bytes, total)
        torch.cuda.set_per_process_memory_fraction(cap / total, 0)
    micro = recipe.batch.micro_batch if recipe.batch.micro_batch != "auto" else 1
    accum = grad_accum_steps(recipe.batch.global_batch, micro, recipe.hardware.gpus)
    config = hf_deepspeed_config(ds_config(recipe, micro))
    tokenizer = load_tokenizer(recipe.model)
    train_set, _ = build_datasets(recipe.data, tokenizer, recipe.train.seed)

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[recipe.precision.compute]
    with tempfile.TemporaryDirectory() as scratch:
        training = TrainingArguments(
            output_dir=scratch, per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
            max_steps=args.steps, learning_rate=recipe.optimizer.lr, weight_decay=recipe.optimizer.weight_decay,
            adam_beta1=recipe.optimizer.betas[0], adam_beta2=recipe.optimizer.betas[1], adam_epsilon=recipe.optimizer.eps,
            max_grad_norm=recipe.optimizer.grad_clip, warmup_steps=recipe.schedule.warmup_steps,
            lr_scheduler_type=recipe.schedule.decay if recipe.schedule.decay != "constant" else "constant_with_warmup",
            bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, logging_steps=10**9, save_strategy="no",
            report_to=[], deepspeed=config, seed=recipe.train.seed, dataloader_num_workers=0,
            gradient_checkpointing=recipe.checkpointing.strategy != "none",
            gradient_checkpointing_kwargs={"use_reentrant": False}, remove_unused_columns=False,
            use_cpu=not on_cuda, use_liger_kernel=args.baseline == "hf-liger",
        )
        torch.manual_seed(recipe.train.seed)
        from transformers import AutoModelForCausalLM

        # Under ZeRO-3 TrainingArguments made the HfDeepSpeedConfig above, so from_config partitions.
        # Otherwise the random init runs on the GPU, as memtrain's does (a 7B init on the CPU takes
        # minutes; real HF users load weights with from_pretrained, which we cannot without a hub).
        zero3 = config["zero_optimization"]["stage"] == 3
        with torch.device("cuda" if on_cuda and not zero3 else "cpu"):
            model = AutoModelForCausalLM.from_config(model_config(recipe.model), dtype=dtype)
        model.config.use_cache = False
        if recipe.model.lora is not None:
            model = add_lora(model, recipe.model)

        marks: list[float] = []

        class Clock(TrainerCallback):
            def on_step_end(self, *_, **__):
                if on_cuda:
                    torch.cuda.synchronize()
                marks.append(time.time())

        trainer = Trainer(model=model, args=training, train_dataset=train_set, callbacks=[Clock()])
        trainer.train()
    tokens_per_step = recipe.batch.global_batch * recipe.data.seq_len
    timed = marks[args.warmup:]
    result = {
        "baseline": args.baseline,
        "tokens_per_s": tokens_per_step * (len(timed) - 1) / (timed[-1] - timed[0]) if len(timed) > 1 else None,
        "steps": len(marks),
        # from the launch of this process, as memtrain's side measures it
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
    raise SystemExit(main())
