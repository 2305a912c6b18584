"""Framework time per micro-batch with next to no compute: what PEFT, checkpointing and DeepSpeed's
ZeRO stages cost on the host, whatever the GPU. A 32-layer Llama with hidden size 64 and LoRA on all
seven projections (the 7B LoRA recipe's 448 trainable tensors) runs forward + backward on 16 tokens,
plainly and under a single-process DeepSpeed engine on the CPU accelerator.

Each engine's micro-batch is timed in --rounds rounds of --repeats calls, the engines taking turns within a round
(so a busy machine slows them alike); the row is the median round. One row per (checkpointing, engine) in --out
(default benchmarks/micro_batch_overhead.csv), with the extra milliseconds over plain PEFT, and its Markdown view.

    python -m scripts.micro_batch_overhead --stages 0,1,2 --checkpointing none,every_layer
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memtrain.model.build import add_lora
from memtrain.model.recompute import apply_checkpointing
from memtrain.model.wrapper import TrainableLM
from memtrain.recipe.schema import Checkpointing, Lora, Model, Precision
from memtrain.train.runtime.distributed import setup_process
from scripts.bench_common import ROOT, machine_name, upsert_row

COLUMNS = [
    "checkpointing",
    "engine",
    "ms_per_micro_batch",
    "extra_ms_over_plain",
    "rounds_ms",
    "machine",
    "date",
    "command",
]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model(strategy: str) -> TrainableLM:
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=512,
        max_position_embeddings=64,
    )
    lora = add_lora(
        LlamaForCausalLM(config), Model(preset="tiny", lora=Lora(r=16, alpha=32, dropout=0.05, target_modules=TARGETS))
    )
    apply_checkpointing(lora, Checkpointing(strategy=strategy))
    lm = TrainableLM(lora, Precision(compute="fp32", loss_chunk_tokens=1024))
    lm.train()
    return lm


def ms_per_call(fn, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default="0,1,2")
    parser.add_argument("--checkpointing", default="none,every_layer")
    parser.add_argument("--repeats", type=int, default=10, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "micro_batch_overhead.csv")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # here: after choosing its CPU accelerator, which DeepSpeed reads at import

    setup_process("rtx3090", cap_memory=False)  # the process group as a run sets it up (gloo on the CPU)
    torch.set_num_threads(1)
    ids = torch.randint(0, 512, (1, 16))
    command = (
        f"python -m scripts.micro_batch_overhead --stages {args.stages} --checkpointing {args.checkpointing} "
        f"--repeats {args.repeats} --rounds {args.rounds}"
    )
    for strategy in args.checkpointing.split(","):
        calls = {}
        lm = model(strategy)

        def plain(lm=lm):
            loss_sum, tokens = lm(input_ids=ids, labels=ids)
            (loss_sum / tokens).backward()

        calls["plain PEFT"] = plain
        for stage in (int(s) for s in args.stages.split(",")):
            lm = model(strategy)  # a module of its own for each engine
            optimizer = torch.optim.AdamW([p for p in lm.parameters() if p.requires_grad], lr=1e-4)
            engine, *_ = deepspeed.initialize(
                model=lm,
                optimizer=optimizer,
                config={
                    "train_micro_batch_size_per_gpu": 1,
                    "gradient_accumulation_steps": 10**6,
                    "zero_allow_untested_optimizer": True,
                    "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True},
                },
            )

            def micro_step(engine=engine):
                engine.set_gradient_accumulation_boundary(False)
                loss_sum, tokens = engine(input_ids=ids, labels=ids)
                engine.backward(loss_sum / tokens, scale_wrt_gas=False)

            calls[f"ZeRO-{stage}"] = micro_step
        for call in calls.values():  # warm-up
            for _ in range(3):
                call()
        rounds = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                rounds[name].append(ms_per_call(call, args.repeats))
        plain_ms = statistics.median(rounds["plain PEFT"])
        for name, times in rounds.items():
            median = statistics.median(times)
            print(f"{strategy:14s} {name:12s} {median:7.1f} ms  (+{median - plain_ms:.1f})", flush=True)
            upsert_row(
                args.out,
                {
                    "checkpointing": strategy,
                    "engine": name,
                    "ms_per_micro_batch": f"{median:.1f}",
                    "extra_ms_over_plain": f"{median - plain_ms:+.1f}",
                    "rounds_ms": " ".join(f"{t:.1f}" for t in times),
                    "machine": machine_name(),
                    "date": dt.date.today().isoformat(),
                    "command": command,
                },
                COLUMNS,
                "Host time per micro-batch (forward + backward) of a 32-layer LoRA model with next to "
                "no compute: what PEFT, checkpointing and DeepSpeed's ZeRO stages cost",
                keys=("checkpointing", "engine", "machine"),
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
