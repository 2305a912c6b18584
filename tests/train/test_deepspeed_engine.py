"""The memory policies under real single-process DeepSpeed engines on the CPU accelerator."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from memtrain.model.precision import apply_precision
from memtrain.model.recompute import apply_checkpointing
from memtrain.model.wrapper import TrainableLM
from memtrain.recipe.schema import Checkpointing, Precision
from memtrain.train.runtime.preflight import cpu_fp16_supported
from tests.model.test_support import one_torch_thread, shakespeare_batches, tiny_llama  # noqa: F401

deepspeed = pytest.importorskip("deepspeed")


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
    if not torch.distributed.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for key, value in dict(
            DS_ACCELERATOR="cpu",
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        ).items():
            os.environ.setdefault(key, value)
        deepspeed.init_distributed(dist_backend="gloo")
    yield


def engine(model, precision: Precision, config: dict, lr: float = 1e-3):
    lm = TrainableLM(model, precision)
    optimizer = torch.optim.AdamW([p for p in lm.parameters() if p.requires_grad], lr=lr)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        **config,
    }
    eng, *_ = deepspeed.initialize(model=lm, optimizer=optimizer, config=config)
    return eng


def step(eng, ids, poison: bool = False) -> float:
    loss_sum, n_tokens = eng(input_ids=ids, labels=ids)
    loss = loss_sum / n_tokens
    eng.backward(loss * float("inf") if poison else loss)
    eng.step()
    return loss.item()


FP32 = Precision(compute="fp32", loss_chunk_tokens=16)


@pytest.mark.slow  # 5-20 s on two cores: plain pytest stays under 2 minutes; scripts/test.sh (CI) runs it
@pytest.mark.parametrize("stage", [2, 3])
def test_checkpointing_under_zero_matches_no_checkpointing(stage):
    batches = shakespeare_batches(8)
    runs = {}
    for name, config in {
        "none": Checkpointing(strategy="none"),
        "selective": Checkpointing(strategy="selective"),
        "every_2_layers": Checkpointing(strategy="every_n_layers", every_n_layers=2),
        "offload_mlp": Checkpointing(strategy="rules", rules={"*.mlp": "offload"}),
        "layer_inputs_on_host": Checkpointing(strategy="every_layer", offload_inputs=True),
    }.items():
        model = tiny_llama()
        plan = apply_checkpointing(model, config)
        eng = engine(model, FP32, {"zero_optimization": {"stage": stage}})
        runs[name] = torch.tensor([step(eng, ids) for ids in batches], dtype=torch.float64)
        if name == "layer_inputs_on_host":  # one input per layer and micro-batch, each brought back for its recompute
            assert plan.offload_stats.packed_tensors == 4 * len(batches)
        if name in ("offload_mlp", "layer_inputs_on_host"):
            assert plan.offload_stats.packed_tensors > 0
            assert plan.offload_stats.unpacked_tensors == plan.offload_stats.packed_tensors
    assert runs["none"][-1] < runs["none"][0] - 0.2
    for name, losses in runs.items():
        assert torch.allclose(losses, runs["none"], rtol=0, atol=1e-5), (stage, name, losses - runs["none"])


def accumulated_run(stage: int, compute: str, batches) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Losses of the micro-batches, 4 accumulated a step, and each weight's change over the steps."""
    config = {"zero_optimization": {"stage": stage}, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0}
    if compute == "bf16":
        config["bf16"] = {"enabled": True}
    model = tiny_llama()
    start = {name: p.detach().float().clone() for name, p in model.named_parameters()}
    eng = engine(model, Precision(compute=compute, loss_chunk_tokens=16), config)
    losses = [step(eng, ids) for ids in batches]
    assert eng.global_steps == len(batches) // 4
    moved = {name: p.detach().float() - start[name] for name, p in model.named_parameters()}
    return torch.tensor(losses, dtype=torch.float64), moved


@pytest.mark.parametrize("compute", ["fp32", "bf16"])
def test_zero1_trains_as_zero2_does_over_accumulated_micro_batches(compute):
    """ZeRO-1, what `offload.zero_stage: auto` gives one GPU holding everything, reduces the gradients once a step
    where ZeRO-2 reduces at every micro-batch: the same optimizer steps, so the same losses and weights."""
    batches = shakespeare_batches(8)
    losses_1, moved_1 = accumulated_run(1, compute, batches)
    losses_2, moved_2 = accumulated_run(2, compute, batches)
    assert torch.equal(losses_1, losses_2), losses_1 - losses_2
    assert losses_1[4:].mean() < losses_1[:4].mean()  # the first step trained
    assert all(torch.equal(moved_1[name], moved_2[name]) for name in moved_1)


def test_stage_0_bf16_takes_shorter_adam_steps_than_zero():
    """Why recipes refuse offload.zero_stage=0 with bf16 weights (memtrain.recipe.rules): DeepSpeed's stage-0 bf16
    optimizer (FP16_UnfusedOptimizer) moves the weights about 0.75x as far as ZeRO-1 on the same micro-batches. Adam's
    first steps are about lr long whatever the gradients' scale, as ZeRO-1's are."""
    batches = shakespeare_batches(4)  # one step
    _, moved_0 = accumulated_run(0, "bf16", batches)
    _, moved_1 = accumulated_run(1, "bf16", batches)
    matrices = [name for name in moved_1 if name.endswith("proj.weight")]
    ratio = sum(moved_0[n].abs().mean() for n in matrices) / sum(moved_1[n].abs().mean() for n in matrices)
    assert 0.6 < ratio < 0.9, ratio
    assert 0.9e-3 < sum(moved_1[n].abs().mean() for n in matrices) / len(matrices) < 1.1e-3  # lr 1e-3


@pytest.mark.skipif(not cpu_fp16_supported(), reason="DeepSpeed's CPU accelerator has no fp16 on this CPU")
@pytest.mark.parametrize("hysteresis", [1, 2])
def test_fp16_overflow_lowers_the_scale_and_skips_the_step(hysteresis):
    """DeepSpeed's fp16 dynamic loss scaler runs on the CPU accelerator (ZeRO-2 optimizer)."""
    precision = Precision(compute="fp16", fp32_modules=["*norm*"], loss_chunk_tokens=16)
    model = tiny_llama()
    apply_precision(model, precision)
    eng = engine(
        model,
        precision,
        {
            "zero_optimization": {"stage": 2},
            "fp16": {
                "enabled": True,
                "initial_scale_power": 8,
                "hysteresis": hysteresis,
                "loss_scale_window": 1000,
                "min_loss_scale": 1,
            },
        },
    )
    batches = shakespeare_batches(2 + hysteresis)
    assert step(eng, batches[0]) < 9 and eng.optimizer.cur_scale == 256 and eng.skipped_steps == 0
    weights = {k: v.detach().clone() for k, v in eng.module.state_dict().items()}
    for overflow in range(1, hysteresis + 1):
        step(eng, batches[overflow], poison=True)
        assert eng.skipped_steps == overflow
        # hysteresis = overflows tolerated before the scale drops
        assert eng.optimizer.cur_scale == (128 if overflow == hysteresis else 256)
        assert all(torch.equal(weights[k], v) for k, v in eng.module.state_dict().items())
    step(eng, batches[-1])
    assert eng.skipped_steps == hysteresis
    assert not all(torch.equal(weights[k], v) for k, v in eng.module.state_dict().items())


@pytest.mark.slow  # 5-20 s on two cores: plain pytest stays under 2 minutes; scripts/test.sh (CI) runs it
def test_lora_bf16_islands_under_zero3_match_no_checkpointing():
    """LoRA + bf16 engine (which casts the fp32 islands' weights) + ZeRO-3 gathering inside the islands."""
    from peft import LoraConfig, get_peft_model

    precision = Precision(compute="bf16", fp32_modules=["*norm*", "lm_head"], loss_chunk_tokens=16)
    batches = shakespeare_batches(6)
    runs = {}
    for name in ("none", "selective", "every_layer"):
        base = tiny_llama()
        torch.manual_seed(1)  # LoRA's A matrices are drawn from the global generator
        model = get_peft_model(
            base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"])
        )
        apply_checkpointing(model, Checkpointing(strategy=name))
        apply_precision(model, precision)
        eng = engine(model, precision, {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}, lr=1e-2)
        runs[name] = torch.tensor([step(eng, ids) for ids in batches], dtype=torch.float64)
    assert runs["none"][-1] < runs["none"][0]
    for name, losses in runs.items():
        assert torch.allclose(losses, runs["none"], rtol=0, atol=1e-5), (name, losses - runs["none"])


@pytest.mark.slow  # 5-20 s on two cores: plain pytest stays under 2 minutes; scripts/test.sh (CI) runs it
@pytest.mark.parametrize("zenflow", [False, True])
def test_deepspeed_zenflow_scrambles_the_weights_it_is_given(zenflow):
    """Why memtrain refuses `offload.zenflow` (recipe checks): DeepSpeed's ZenFlow (ZeRO-2, optimizer on the CPU)
    flattens each weight matrix transposed and hands the model views of the original shape, so after
    deepspeed.initialize every matrix holds its own transpose, reshaped. Plain ZeRO-Offload keeps them.
    When this fails for zenflow=True, DeepSpeed has fixed the layout: the refusal can be lifted."""
    model = tiny_llama(layers=2)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    if zenflow:
        zero["zenflow"] = {
            "topk_ratio": 0.1,
            "select_strategy": "step",
            "select_interval": 4,
            "update_interval": 4,
            "overlap_step": False,
        }
    eng, *_ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_allow_untested_optimizer": True,
        },
    )
    matrices = {name: p for name, p in eng.module.named_parameters() if p.dim() == 2}
    assert len(matrices) == 2 * 7 + 2  # 7 projections per layer, embedding and head
    for name, p in matrices.items():
        original = before[name]
        transposed_reshaped = original.t().contiguous().view(original.shape)
        if zenflow:
            assert torch.equal(p.detach(), transposed_reshaped) and not torch.equal(p.detach(), original), name
        else:
            assert torch.equal(p.detach(), original), name


@pytest.mark.slow  # 5-20 s on two cores: plain pytest stays under 2 minutes; scripts/test.sh (CI) runs it
def test_loraplus_trains_the_b_matrices_at_lr_times_the_ratio_through_the_schedule(process_group, write_recipe):
    """LoRA+ reaches DeepSpeed's optimizer as two parameter groups, and memtrain's LR schedule keeps their ratio."""
    from memtrain.ds_config.compiler import ds_config
    from memtrain.recipe.load import load_recipe
    from memtrain.train.setup import build_engine, build_policy_model

    path = write_recipe(
        "loraplus",
        {
            "model": {"lora": {"r": 4, "alpha": 8, "loraplus_lr_ratio": 16.0, "target_modules": ["q_proj", "v_proj"]}},
            "schedule": {"warmup_steps": 2},
        },
    )
    recipe = load_recipe(path).recipe
    config = ds_config(recipe, micro_batch=4)
    engine, scheduler = build_engine(recipe, build_policy_model(recipe, process_group, config), config, total_steps=10)
    groups = engine.optimizer.param_groups  # ZeRO-2: one flat partition per group, its params in bit16_groups
    names = {id(p): n for n, p in engine.module.named_parameters()}
    members = [[names[id(p)] for p in params] for params in engine.optimizer.bit16_groups]
    assert len(groups) == len(members) == 2
    fast = [g for g, m in zip(groups, members) if all(".lora_B." in n for n in m)]
    slow = [g for g, m in zip(groups, members) if all(".lora_A." in n for n in m)]
    assert len(fast) == 1 and len(slow) == 1
    for _ in range(3):  # through warmup: both rates move, their ratio stays
        assert fast[0]["lr"] == pytest.approx(16 * slow[0]["lr"])
        scheduler.step()
    assert slow[0]["lr"] > 0
