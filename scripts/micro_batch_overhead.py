"""Framework time per micro-batch with next to no compute: what PEFT, checkpointing and DeepSpeed's
ZeRO stages cost on the host, whatever the GPU. A 32-layer Llama with hidden size 64 and LoRA on all
seven projections (the 7B LoRA recipe's 448 trainable tensors) runs forward + backward on 16 tokens,
plainly and under a single-process DeepSpeed engine on the CPU accelerator.

    python scripts/micro_batch_overhead.py --stages 0,1,2 --checkpointing none,every_layer
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memtrain.model.build import add_lora  # noqa: E402
from memtrain.model.checkpointing import apply_checkpointing  # noqa: E402
from memtrain.model.wrapper import TrainableLM  # noqa: E402
from memtrain.recipe.schema import Checkpointing, Lora, Model, Precision  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model(strategy: str) -> TrainableLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=32, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=512, max_position_embeddings=64)
    lora = add_lora(LlamaForCausalLM(config), Model(preset="tiny", lora=Lora(r=16, alpha=32, dropout=0.05,
                                                                            target_modules=TARGETS)))
    apply_checkpointing(lora, Checkpointing(strategy=strategy))
    lm = TrainableLM(lora, Precision(compute="fp32", loss_chunk_tokens=1024))
    lm.train()
    return lm


def ms_per_call(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default="0,1,2")
    parser.add_argument("--checkpointing", default="none,every_layer")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    from memtrain.train.distributed import setup_process

    setup_process("rtx3090", cap_memory=False)  # the process group as a run sets it up (gloo on the CPU)
    torch.set_num_threads(1)
    ids = torch.randint(0, 512, (1, 16))
    print("checkpointing  engine        ms per micro-batch (forward + backward)")
    for strategy in args.checkpointing.split(","):
        lm = model(strategy)

        def plain():
            loss_sum, tokens = lm(input_ids=ids, labels=ids)
            (loss_sum / tokens).backward()

        print(f"{strategy:14s} plain PEFT    {ms_per_call(plain, args.repeats):7.1f}")
        for stage in (int(s) for s in args.stages.split(",")):
            optimizer = torch.optim.AdamW([p for p in lm.parameters() if p.requires_grad], lr=1e-4)
            engine, *_ = deepspeed.initialize(model=lm, optimizer=optimizer, config={
                "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 16,
                "zero_allow_untested_optimizer": True,
                "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}})

            def micro_step(engine=engine):
                engine.set_gradient_accumulation_boundary(False)
                loss_sum, tokens = engine(input_ids=ids, labels=ids)
                engine.backward(loss_sum / tokens, scale_wrt_gas=False)

            print(f"{strategy:14s} ZeRO-{stage}        {ms_per_call(micro_step, args.repeats):7.1f}")
            lm = model(strategy)  # a fresh module for the next engine
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
