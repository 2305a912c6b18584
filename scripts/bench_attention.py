"""Time one packed training step of a 7B-shaped layer stack under each way of attending: what packing costs.

The model is the recipe preset's shape (llama2-7b by default) cut to --layers decoder layers, with LoRA r16 on
every linear layer, in bf16, built with memtrain's own config and wrapper (model/config.py, model/wrapper.py), so
the rows reach attention as in a run. The rows are packed by memtrain's packer (data/rows/packing.py) from sample
lengths drawn like multi-turn chat (log-uniform, 100 to 1,500 tokens) and laid out as memtrain lays them (position
ids restarting per sample, padding continuing the last sample). Each kernel times forward + backward of the same
micro-batch:

  sdpa-mask   sdpa with the packed rows: transformers builds a dense block-diagonal mask (memtrain's packed path
              under model.attn_implementation: sdpa)
  varlen      PyTorch's variable-length flash kernel with the samples' bounds (model.attn_implementation: varlen,
              what auto takes for packed rows on a CUDA GPU of compute capability 8.0+)
  sdpa-plain  the same tokens as plain rows (no restarts: one causal sequence per row): the speed of text, the
              ceiling packing is measured against (its attention crosses samples, so it is not a training option)

Writes one CSV row per kernel (real tokens/s: the rows' tokens without padding; peak allocated memory), with the
command, machine and date, appended to --out (benchmarks/attention.csv by default). Runs on the CPU too (a tiny
preset, for its test; the varlen kernel is CUDA's alone, so the CPU times memtrain's by-sample reference).

    python scripts/bench_attention.py --layers 4 --micro-batch 2 --seq-len 2048 --steps 10 --warmup 3
"""

from __future__ import annotations

import argparse
import csv
import datetime
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from memtrain.data.rows.packing import pack_rows
from memtrain.labels import IGNORE_INDEX
from memtrain.model.build import add_lora
from memtrain.model.config import model_config
from memtrain.model.wrapper import TrainableLM
from memtrain.recipe.schema import Model, Precision

KERNELS = {"sdpa-mask": "sdpa", "varlen": "varlen", "sdpa-plain": "sdpa"}
COLUMNS = (
    "kernel",
    "preset",
    "layers",
    "micro_batch",
    "seq_len",
    "samples",
    "padding_share",
    "step_s",
    "tokens_per_s",
    "peak_allocated_gib",
    "machine",
    "date",
    "command",
)


def packed_rows(micro_batch: int, seq_len: int, vocab_size: int, seed: int) -> tuple[dict, int, int]:
    """(batch of rows as memtrain lays them, samples in it, real tokens): enough chat-like samples drawn and packed
    to fill `micro_batch` rows, the first rows taken."""
    rng = np.random.default_rng(seed)
    longest = min(1500, seq_len)
    lengths = np.exp(rng.uniform(np.log(min(100, longest)), np.log(longest), size=micro_batch * seq_len // 100 + 8))
    lengths = lengths.astype(np.int64)
    rows = pack_rows(lengths, seq_len)[:micro_batch]
    input_ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
    labels = torch.full((micro_batch, seq_len), IGNORE_INDEX)
    positions = torch.zeros(micro_batch, seq_len, dtype=torch.long)
    samples = tokens = 0
    for r, row in enumerate(rows):
        at = 0
        for index in row:
            n = int(lengths[index])
            ids = torch.from_numpy(rng.integers(3, vocab_size, size=n))
            input_ids[r, at : at + n] = ids
            labels[r, at + 1 : at + n] = ids[1:]
            positions[r, at : at + n] = torch.arange(n)
            at += n
        positions[r, at:] = torch.arange(positions[r, at - 1] + 1, positions[r, at - 1] + 1 + seq_len - at)
        samples, tokens = samples + len(row), tokens + at
    return {"input_ids": input_ids, "labels": labels, "position_ids": positions}, samples, tokens


def build(preset: str, layers: int, attention: str, device: torch.device, dtype: torch.dtype) -> TrainableLM:
    recipe_model = Model(preset=preset, attn_implementation=attention, lora={"r": 16, "target_modules": "all-linear"})
    config = model_config(recipe_model)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.use_cache = False
    model = add_lora(model, recipe_model).to(dtype)
    compute = "bf16" if dtype == torch.bfloat16 else "fp32"
    return TrainableLM(model, Precision(compute=compute))


def time_steps(model: TrainableLM, batch: dict, steps: int, warmup: int, on_cuda: bool) -> list[float]:
    times = []
    for _ in range(warmup + steps):
        if on_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        loss_sum, _ = model(**batch)
        loss_sum.backward()
        if on_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times[warmup:]


def machine() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama2-7b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--kernels", nargs="+", choices=tuple(KERNELS), default=list(KERNELS))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/attention.csv"))
    args = parser.parse_args()

    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda" if on_cuda else "cpu")
    dtype = torch.bfloat16 if on_cuda else torch.float32
    command = "python " + shlex.join(["scripts/bench_attention.py", *sys.argv[1:]])
    rows = []
    for kernel in args.kernels:
        model = build(args.preset, args.layers, KERNELS[kernel], device, dtype)
        vocab = model.model.get_input_embeddings().num_embeddings
        batch, samples, tokens = packed_rows(args.micro_batch, args.seq_len, vocab, seed=0)
        if kernel == "sdpa-plain":  # the same tokens as one causal sequence per row
            batch = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
        batch = {name: tensor.to(device) for name, tensor in batch.items()}
        if on_cuda:
            torch.cuda.reset_peak_memory_stats()
        step_s = statistics.median(time_steps(model, batch, args.steps, args.warmup, on_cuda))
        row = {
            "kernel": kernel,
            "preset": args.preset,
            "layers": args.layers,
            "micro_batch": args.micro_batch,
            "seq_len": args.seq_len,
            "samples": samples,
            "padding_share": f"{1 - tokens / (args.micro_batch * args.seq_len):.3f}",
            "step_s": f"{step_s:.4f}",
            "tokens_per_s": f"{tokens / step_s:.0f}",
            "peak_allocated_gib": f"{torch.cuda.max_memory_allocated() / 2**30:.2f}" if on_cuda else "",
            "machine": machine(),
            "date": datetime.date.today().isoformat(),
            "command": command,
        }
        rows.append(row)
        print(", ".join(f"{k}={row[k]}" for k in COLUMNS[:-3]), flush=True)
        del model
        if on_cuda:
            torch.cuda.empty_cache()
    new_file = not args.out.exists()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        if new_file:
            writer.writeheader()
        writer.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
