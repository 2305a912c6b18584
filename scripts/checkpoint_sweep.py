"""Activation-checkpointing sweep on a GPU: peak memory and step time per strategy under a memory cap.

    python -m scripts.checkpoint_sweep --preset tinyllama-1.1b --micro-batch 4 --seq-len 1024 --out sweep.csv
    python -m scripts.checkpoint_sweep --preset llama2-7b --lora --micro-batch 4 --seq-len 1024 --out sweep.csv

Each strategy gets a freshly built model (bf16 compute, chunked fp32 loss, the recipe defaults) and
a plain torch AdamW, runs --steps optimizer steps on Shakespeare tokens, and becomes one CSV row.
A strategy that runs out of memory is a row with 'oom', not the end of the sweep. An existing
--out file is appended to, so the 1.1B and 7B runs can share one table.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from memtrain.data.read.corpus import read_documents
from memtrain.model.build import add_lora
from memtrain.model.config import model_config
from memtrain.model.precision import apply_precision, compute_dtype
from memtrain.model.recompute import apply_checkpointing
from memtrain.model.wrapper import TrainableLM
from memtrain.recipe.schema import Checkpointing, Lora, Model, Precision

GiB = 1024**3
COLUMNS = [
    "recipe",
    "strategy",
    "peak_allocated_gib",
    "peak_reserved_gib",
    "step_time_s",
    "tokens_per_s",
    "machine",
    "date",
    "command",
]
STRATEGIES = {
    "none": Checkpointing(strategy="none"),
    "every_1": Checkpointing(strategy="every_layer"),
    "every_2": Checkpointing(strategy="every_n_layers", every_n_layers=2),
    "every_4": Checkpointing(strategy="every_n_layers", every_n_layers=4),
    "every_8": Checkpointing(strategy="every_n_layers", every_n_layers=8),
    "selective": Checkpointing(strategy="selective"),
    "offload": Checkpointing(strategy="rules", rules={"model.layers.*": "offload"}),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", required=True, help="model shape preset in configs/models")
    parser.add_argument(
        "--lora", action="store_true", help="train LoRA adapters (recipe defaults) instead of all weights"
    )
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per strategy; the first is warm-up")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help=f"comma list of {', '.join(STRATEGIES)}")
    parser.add_argument("--cap-gib", type=float, default=24.0, help="emulated card size (GPU only)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", required=True, type=Path, help="CSV file (appended to when it exists)")
    args = parser.parse_args(argv)
    unknown = [s for s in args.strategies.split(",") if s not in STRATEGIES]
    if unknown:
        parser.error(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is warm-up)")
    return args


def shakespeare_ids(n_tokens: int, vocab_size: int) -> torch.Tensor:
    """The first n_tokens of the bundled corpus with the bundled tokenizer (ids < 4096 fit any preset)."""
    tokenizer_file = Path(__file__).resolve().parents[1] / "memtrain/assets/tokenizer/shakespeare/tokenizer.json"
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file))
    ids: list[int] = []
    for doc in read_documents("builtin:shakespeare"):
        ids.extend(tokenizer(doc)["input_ids"])
        if len(ids) >= n_tokens:
            break
    ids = (ids * (n_tokens // max(len(ids), 1) + 1))[:n_tokens]
    return torch.tensor(ids) % vocab_size


def build(args, strategy: Checkpointing, precision: Precision, device: torch.device):
    """A fresh model on the device with the strategy and precision applied, and its optimizer."""
    model_section = Model(preset=args.preset, lora=Lora() if args.lora else None)
    config = model_config(model_section)
    with device:  # random init straight on the GPU: a 7B model on the CPU takes minutes
        model = AutoModelForCausalLM.from_config(config, dtype=compute_dtype(precision))
    if args.lora:
        model = add_lora(model, model_section)  # memtrain's own LoRA wrapping, as a run builds it
    model.train()
    apply_checkpointing(model, strategy)
    apply_precision(model, precision)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    return model, optimizer, config.vocab_size


def measure(args, name: str, device: torch.device) -> dict:
    """One row: peaks over all steps after the model is built, median time of the steps after the first."""
    precision = Precision(compute="bf16")
    cuda = device.type == "cuda"
    model = optimizer = None
    try:
        model, optimizer, vocab = build(args, STRATEGIES[name], precision, device)
        lm = TrainableLM(model, precision)
        tokens = shakespeare_ids(args.steps * args.micro_batch * args.seq_len, vocab)
        batches = tokens.view(args.steps, args.micro_batch, args.seq_len).to(device)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for ids in batches:
            start = time.perf_counter()
            loss_sum, n_tokens = lm(input_ids=ids, labels=ids)
            (loss_sum / n_tokens).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        step_time_s = statistics.median(times[1:])
        row = {
            "step_time_s": f"{step_time_s:.4f}",
            "tokens_per_s": f"{args.micro_batch * args.seq_len / step_time_s:.1f}",
        }
        if cuda:
            row["peak_allocated_gib"] = f"{torch.cuda.max_memory_allocated() / GiB:.3f}"
            row["peak_reserved_gib"] = f"{torch.cuda.max_memory_reserved() / GiB:.3f}"
        else:
            row["peak_allocated_gib"] = row["peak_reserved_gib"] = "n/a"
        print(f"{name:10s} loss {loss_sum.item() / n_tokens.item():.3f} {row}", flush=True)
        return row
    except torch.OutOfMemoryError as err:
        print(f"{name:10s} out of memory: {str(err).splitlines()[0]}", flush=True)
        return dict.fromkeys(["peak_allocated_gib", "peak_reserved_gib", "step_time_s", "tokens_per_s"], "oom")
    finally:
        del model, optimizer
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        total_bytes = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GiB / total_bytes))
        machine = f"{torch.cuda.get_device_name(0)} capped to {args.cap_gib:g} GiB"
    else:
        machine = f"{platform.machine()} CPU ({platform.node()})"
    recipe = f"{args.preset}{'-lora' if args.lora else '-full'}-mb{args.micro_batch}-seq{args.seq_len}"
    command = shlex.join(["python", "-m", "scripts.checkpoint_sweep", *(argv if argv is not None else sys.argv[1:])])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    new_file = not args.out.exists()
    with args.out.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        if new_file:
            writer.writeheader()
        for name in args.strategies.split(","):
            row = {
                "recipe": recipe,
                "strategy": name,
                "machine": machine,
                "date": date,
                "command": command,
                **measure(args, name, device),
            }
            writer.writerow(row)
            f.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
