"""The alternative memtrain is measured against: Hugging Face Trainer + DeepSpeed on the same recipe.

Same model shape and initialisation seed, same global batch, precision, checkpointing (HF's gradient
checkpointing, every layer), LoRA and ZeRO offload tiers (memtrain's compiled DeepSpeed config, handed
to the Trainer as Axolotl and LLaMA-Factory do), same memory cap. Same data, batch for batch: memtrain's
public builder (train/setup.build_data) makes the rows (text windows, or for instruction and chat data
the templated, response-masked rows, packed with position_ids that restart per sample), memtrain's
sample order picks each step's rows and memtrain's collate makes each micro-batch (cut to its longest
row when the recipe groups by length). The Trainer hands input_ids, labels and position_ids to the
model with no attention_mask, so transformers keeps packed samples apart exactly as on memtrain's side
(masking_utils.find_packed_sequence_indices for sdpa / eager / flex; for flash attention the rows go
in end to end, as memtrain's TrainableLM lays them, see model/wrapper.py PACKED_ATTENTION).

Prints one JSON line and writes it to --out: real tokens/s after the warm-up steps (padding left out, as memtrain's
train records count them) and target tokens/s (the positions the loss is computed on: responses only for chat data),
time to the first step, peak GPU memory, host peak RSS. That is what scripts/bench_vs_hf.py reads from every
baseline (the `hf` and `hf-liger` baselines of benchmarks/suites.yaml run this script). Runs on the CPU too (for its
test, tests/scripts/test_hf_baseline.py).

    python -m scripts.hf_baseline RECIPE [key=value ...] --steps 12 --warmup 3 --out result.json [--baseline hf-liger]

--baseline hf-liger: the same Trainer with `use_liger_kernel=True` (transformers applies Liger's fused linear
cross-entropy, RMSNorm, SwiGLU and RoPE to the model instance, through the PEFT wrapper, when training starts):
the strongest baseline a user would pick without writing code. Needs liger-kernel and a CUDA GPU.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

from memtrain.data.rows.loader import collate, sample_order
from memtrain.data.rows.row_set import SampleRows
from memtrain.ds_config.compiler import ds_config
from memtrain.model.build import add_lora
from memtrain.model.config import model_config
from memtrain.model.wrapper import check_packed_attention, needs_one_sequence, one_sequence
from memtrain.plan.planner import resolve_micro_batch
from memtrain.plan.zero import grad_accum_steps
from memtrain.recipe.load import load_recipe
from memtrain.recipe.schema import Recipe
from memtrain.train.setup import build_data
from scripts.baseline_common import (  # noqa: F401 (per_second: the tests read it here)
    DTYPES,
    cap_to_card,
    measured,
    per_second,
    report,
    run_main,
    start_alone,
    trainer_settings,
)


class RowIndices(torch.utils.data.Dataset):
    """Item i is i: the collator builds each micro-batch from memtrain's rows (`MemtrainBatches`)."""

    def __init__(self, n_rows: int):
        self.n_rows = n_rows

    def __len__(self) -> int:
        return self.n_rows

    def __getitem__(self, index: int) -> int:
        return index


class MemtrainBatches:
    """The Trainer's collate_fn: memtrain's micro-batch of these rows, as the model on memtrain's side gets it."""

    def __init__(self, rows, trim: bool, attn_implementation: str):
        self.rows, self.trim, self.attn = rows, trim, attn_implementation

    def __call__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        batch = collate(self.rows, list(indices), self.trim)
        if "position_ids" in batch and needs_one_sequence(self.attn, batch["input_ids"].shape[0]):
            ids, labels, positions = one_sequence(batch["input_ids"], batch["labels"], batch["position_ids"])
            batch = {"input_ids": ids, "labels": labels, "position_ids": positions}
        return batch


class RunOrder(torch.utils.data.Sampler):
    """memtrain's sample order for `steps` steps: the Trainer takes micro_batch x accumulation rows per step
    from it in turn, so every step trains on the rows memtrain's step of the same number does."""

    def __init__(self, recipe: Recipe, rows, steps: int):
        order = sample_order(recipe.data, rows, recipe.train.seed, recipe.batch.global_batch)
        self.indices = order.indices(0, steps * recipe.batch.global_batch)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def target_tokens_per_step(recipe: Recipe, rows, steps: int) -> list[int]:
    """Target tokens of each step's global batch, as memtrain's loop counts them (dataset.targets)."""
    order = sample_order(recipe.data, rows, recipe.train.seed, recipe.batch.global_batch)
    batch = recipe.batch.global_batch
    return [rows.targets(order.indices(step * batch, batch)) for step in range(steps)]


def real_tokens_per_step(recipe: Recipe, rows, steps: int) -> list[int]:
    """Real (non-padding) tokens of each step's global batch, as memtrain's loop counts them (dataset.tokens_of)."""
    order = sample_order(recipe.data, rows, recipe.train.seed, recipe.batch.global_batch)
    batch = recipe.batch.global_batch
    return [rows.tokens_of(order.indices(step * batch, batch)) for step in range(steps)]


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

    loaded = load_recipe(args.recipe, args.overrides)
    recipe = loaded.recipe
    start_alone()
    on_cuda = cap_to_card(recipe)
    # 'auto' (the default): the size memtrain's planner gives this recipe, so both sides run one micro-batch size
    # unless the case names one (bench_vs_hf: a shared batch.micro_batch=4 gives HF what a user would write)
    micro = recipe.batch.micro_batch if recipe.batch.micro_batch != "auto" else resolve_micro_batch(recipe)
    accum = grad_accum_steps(recipe.batch.global_batch, micro, recipe.hardware.gpus)
    config = hf_deepspeed_config(ds_config(recipe, micro))
    with loaded.sources.located():  # problems at the recipe's file:line
        data = build_data(recipe)  # memtrain's rows, checked against the model and the global batch
    rows = data.train_set
    architecture = model_config(recipe.model)  # with the attention kernel memtrain runs this architecture with
    attn = architecture._attn_implementation
    if isinstance(rows, SampleRows):  # position_ids go to the model: memtrain refuses a kernel that would cross them
        check_packed_attention(attn)

    dtype = DTYPES[recipe.precision.compute]
    with tempfile.TemporaryDirectory() as scratch:
        training = TrainingArguments(
            **trainer_settings(recipe, micro_batch=micro, accum=accum, steps=args.steps, output_dir=scratch),
            lr_scheduler_type=recipe.schedule.decay if recipe.schedule.decay != "constant" else "constant_with_warmup",
            deepspeed=config,
            remove_unused_columns=False,
            use_liger_kernel=args.baseline == "hf-liger",
        )
        torch.manual_seed(recipe.train.seed)
        # Under ZeRO-3 TrainingArguments made the HfDeepSpeedConfig above, so from_config partitions.
        # Otherwise the random init runs on the GPU, as memtrain's does (a 7B init on the CPU takes
        # minutes; real HF users load weights with from_pretrained, which we cannot without a hub).
        zero3 = config["zero_optimization"]["stage"] == 3
        with torch.device("cuda" if on_cuda and not zero3 else "cpu"):
            model = AutoModelForCausalLM.from_config(architecture, dtype=dtype)
            if data.model_vocab_size is not None:  # the template's markers were added to the tokenizer
                model.resize_token_embeddings(data.model_vocab_size)
        model.config.use_cache = False  # also what lets transformers see packed samples (no cache: masking_utils)
        if recipe.model.lora is not None:
            model = add_lora(model, recipe.model)

        marks: list[float] = []

        class Clock(TrainerCallback):
            def on_step_end(self, *_, **__):
                if on_cuda:
                    torch.cuda.synchronize()
                marks.append(time.time())

        order = RunOrder(recipe, rows, args.steps)

        class InRunOrder(Trainer):
            def _get_train_sampler(self, train_dataset=None):
                return order

        trainer = InRunOrder(
            model=model,
            args=training,
            train_dataset=RowIndices(len(rows)),
            callbacks=[Clock()],
            data_collator=MemtrainBatches(rows, recipe.data.groups_by_length, attn),
        )
        trainer.train()
    steps = len(marks)
    result = measured(
        args.baseline,
        tokens=real_tokens_per_step(recipe, rows, steps),  # padding left out, as memtrain's train records count
        targets=target_tokens_per_step(recipe, rows, steps),
        marks=marks,
        warmup=args.warmup,
    )
    report(result, args.out)
    return 0


if __name__ == "__main__":
    run_main(main)
