"""The fused scan for non-finite gradients (memtrain.train.optim.overflow_scan) under real DeepSpeed engines on the CPU:
it finds what DeepSpeed's tensor-by-tensor scan finds, and a step with an inf or NaN gradient is still skipped."""

from __future__ import annotations

import pytest
import torch

from memtrain.recipe.schema import Precision
from memtrain.train.optim.overflow_scan import SERIAL_SCAN, fuse_overflow_scan, gradients_held
from tests.model.test_support import one_torch_thread, shakespeare_batches, tiny_llama  # noqa: F401
from tests.train.test_deepspeed_engine import engine, single_process_group, step  # noqa: F401

BF16 = Precision(compute="bf16", loss_chunk_tokens=16)


def zero_engine(stage: int, **config):
    return engine(
        tiny_llama(),
        BF16,
        {"zero_optimization": {"stage": stage}, "bf16": {"enabled": True}, "gradient_clipping": 1.0, **config},
    )


def serial_scan(optimizer) -> bool:
    """DeepSpeed's own scan, as its class defines it."""
    return bool(getattr(type(optimizer), SERIAL_SCAN)(optimizer))


@pytest.mark.parametrize("stage", [1, 2])
def test_the_fused_scan_finds_what_deepspeeds_scan_finds(stage):
    eng = zero_engine(stage, gradient_accumulation_steps=2)
    assert fuse_overflow_scan(eng)
    batches = shakespeare_batches(2)
    loss_sum, tokens = eng(input_ids=batches[0], labels=batches[0])
    eng.backward(loss_sum / tokens)
    eng.step()  # not a boundary: nothing is scanned yet
    loss_sum, tokens = eng(input_ids=batches[1], labels=batches[1])
    eng.backward(loss_sum / tokens)
    optimizer = eng.optimizer
    gradients = gradients_held(optimizer)
    assert len(gradients) > 20  # one per trainable tensor of the tiny model, not one flat buffer
    assert not bool(getattr(optimizer, SERIAL_SCAN)()) and not serial_scan(optimizer)
    for bad in (float("nan"), float("inf"), -float("inf")):
        last = gradients[-1].view(-1)
        kept = last[3].clone()
        last[3] = bad  # one value of one tensor
        fused = getattr(optimizer, SERIAL_SCAN)()
        assert fused.shape == (1,) and fused.dtype == torch.bool
        assert bool(fused) and serial_scan(optimizer), bad
        last[3] = kept
    assert not bool(getattr(optimizer, SERIAL_SCAN)())


def test_a_step_with_a_non_finite_gradient_is_skipped_and_the_next_one_trains():
    eng = zero_engine(1)
    assert fuse_overflow_scan(eng)
    batches = shakespeare_batches(3)
    step(eng, batches[0])
    weights = {k: v.detach().clone() for k, v in eng.module.state_dict().items()}
    step(eng, batches[1], poison=True)  # the loss times inf: every gradient inf or NaN
    assert eng.skipped_steps == 1
    assert all(torch.equal(weights[k], v) for k, v in eng.module.state_dict().items())
    step(eng, batches[2])
    assert eng.skipped_steps == 1
    assert not all(torch.equal(weights[k], v) for k, v in eng.module.state_dict().items())


@pytest.mark.parametrize("stage", [0, 3])
def test_engines_without_the_serial_scan_are_left_alone(stage):
    eng = engine(tiny_llama(), Precision(compute="fp32", loss_chunk_tokens=16), {"zero_optimization": {"stage": stage}})
    assert not fuse_overflow_scan(eng)
