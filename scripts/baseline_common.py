"""What the baseline scripts (HF Trainer, TRL's SFTTrainer and DPOTrainer) share: starting one process alone, the
recipe's card as the memory cap, the Trainer settings a recipe implies, and the JSON result bench_vs_hf reads.

Each baseline reports the same fields the same way, so their rows compare with memtrain's and with each other:
real tokens/s (padding left out) and target tokens/s after the warm-up steps, time from this process's start to
its first step, peak GPU memory, host peak RSS.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from collections.abc import Callable
from pathlib import Path

import psutil
import torch

from memtrain.configs import gpu_profile
from memtrain.errors import UserError
from memtrain.recipe.schema import Recipe
from memtrain.train.runtime.distributed import free_port

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def start_alone() -> None:
    """The rank variables DeepSpeed and accelerate need to start one process without a launcher."""
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )


def cap_to_card(recipe: Recipe) -> bool:
    """Cap this process's CUDA allocator to the recipe's card (hardware.gpu), as memtrain's run does; whether a CUDA
    device is there."""
    if not torch.cuda.is_available():
        return False
    total = torch.cuda.get_device_properties(0).total_memory
    cap = min(gpu_profile(recipe.hardware.gpu).memory_bytes, total)
    torch.cuda.set_per_process_memory_fraction(cap / total, 0)
    return True


def trainer_settings(recipe: Recipe, *, micro_batch: int, accum: int, steps: int, output_dir: str) -> dict:
    """The TrainingArguments (and SFTConfig / DPOConfig) a user of these trainers writes for the recipe: its batch,
    optimizer, warm-up, precision and every-layer checkpointing, nothing logged or saved."""
    dtype = DTYPES[recipe.precision.compute]
    optimizer = recipe.optimizer
    return {
        "output_dir": output_dir,
        "per_device_train_batch_size": micro_batch,
        "gradient_accumulation_steps": accum,
        "max_steps": steps,
        "learning_rate": optimizer.lr,
        "weight_decay": optimizer.weight_decay,
        "adam_beta1": optimizer.betas[0],
        "adam_beta2": optimizer.betas[1],
        "adam_epsilon": optimizer.eps,
        "max_grad_norm": optimizer.grad_clip,
        "warmup_steps": recipe.schedule.warmup_steps,
        "bf16": dtype == torch.bfloat16,
        "fp16": dtype == torch.float16,
        "logging_steps": 10**9,
        "save_strategy": "no",
        "report_to": [],
        "seed": recipe.train.seed,
        "dataloader_num_workers": 0,
        "gradient_checkpointing": recipe.checkpointing.strategy != "none",
        "gradient_checkpointing_kwargs": {"use_reentrant": False},
        "use_cpu": not torch.cuda.is_available(),
    }


def per_second(counts: list[int], marks: list[float], warmup: int) -> float | None:
    """Tokens per second over the steps after the warm-up: counts[i] of step i+1, done at marks[i]."""
    if len(marks) - warmup < 2:
        return None
    return sum(counts[warmup + 1 : len(marks)]) / (marks[-1] - marks[warmup])


def measured(baseline: str, *, tokens: list[int], targets: list[int], marks: list[float], warmup: int, **more) -> dict:
    """The result bench_vs_hf reads: per-step real and target tokens over the step end times `marks`, and memory."""
    on_cuda = torch.cuda.is_available()
    return {
        "baseline": baseline,
        "tokens_per_s": per_second(tokens, marks, warmup),
        "target_tokens_per_s": per_second(targets, marks, warmup),
        **more,
        "steps": len(marks),
        # from the launch of this process, as memtrain's side measures it
        "time_to_first_step_s": (marks[0] - psutil.Process().create_time()) if marks else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if on_cuda else 0.0,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if on_cuda else 0.0,
        "host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30,
    }


def report(result: dict, out: Path) -> None:
    """Write the result where bench_vs_hf reads it, and print it as one JSON line."""
    out.write_text(json.dumps(result))
    print(json.dumps(result))


def run_main(main: Callable[[], int]) -> None:
    """A baseline's entry point: a recipe or data problem is its message, file:line and fix, not a traceback."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        raise SystemExit(main())
    except UserError as error:
        print(error, file=sys.stderr)
        raise SystemExit(error.exit_code) from None
