"""The multi-tensor gradient norm (memtrain.train.optim.grad_norm) under real DeepSpeed engines on the CPU: it measures
what DeepSpeed's tensor-by-tensor norm measures, marks an inf or NaN gradient the same way, and clipped training with
it moves the weights as DeepSpeed's own does."""

from __future__ import annotations

import pytest
import torch

from memtrain.recipe.schema import Precision
from memtrain.train.optim.grad_norm import SERIAL_NORM, counted_gradients, fuse_grad_norm
from memtrain.train.optim.overflow_scan import gradients_held
from tests.model.test_support import one_torch_thread, shakespeare_batches, tiny_llama  # noqa: F401
from tests.train.test_deepspeed_engine import engine, single_process_group, step  # noqa: F401

BF16 = Precision(compute="bf16", loss_chunk_tokens=16)


def zero_engine(stage: int, clipping: float = 1.0, **config):
    torch.manual_seed(0)
    return engine(
        tiny_llama(),
        BF16,
        {"zero_optimization": {"stage": stage}, "bf16": {"enabled": True}, "gradient_clipping": clipping, **config},
    )


def per_tensor_norm(optimizer, gradients, params, norm_type=2) -> torch.Tensor:
    """DeepSpeed's own norm, as its class defines it."""
    return getattr(type(optimizer), SERIAL_NORM)(optimizer, gradients, params, norm_type)


def boundary_gradients(eng):
    """The optimizer's gradients at an accumulation boundary, before its step: (gradients, parameters) of group 0."""
    batches = shakespeare_batches(1)
    loss_sum, tokens = eng(input_ids=batches[0], labels=batches[0])
    eng.backward(loss_sum / tokens)
    optimizer = eng.optimizer
    assert len(optimizer.bit16_groups) == 1
    return optimizer.averaged_gradients[0], optimizer.params_in_partition[0]


@pytest.mark.parametrize("stage", [1, 2])
def test_the_fused_norm_measures_what_deepspeeds_norm_measures(stage):
    eng = zero_engine(stage)
    assert fuse_grad_norm(eng)
    gradients, params = boundary_gradients(eng)
    optimizer = eng.optimizer
    counted = counted_gradients(optimizer, gradients, params)
    assert len(counted) > 20  # one per trainable tensor of the tiny model, not one flat buffer
    fused = getattr(optimizer, SERIAL_NORM)(gradients, params)
    expected = per_tensor_norm(optimizer, gradients, params)
    by_hand = torch.cat([g.double().flatten() for g in counted]).norm()
    assert fused.dtype == torch.float32 and fused.dim() == 0
    assert float(fused) > 0
    # each tensor's norm accumulated in fp32 where DeepSpeed casts to fp64: on the CPU a 4096 × 64 gradient's norm
    # came out 6e-5 apart, the whole norm 1.3e-5
    assert float(fused) == pytest.approx(float(expected), rel=1e-4)
    assert float(fused) == pytest.approx(float(by_hand), rel=1e-4)
    # the inf-norm is not fused: DeepSpeed's own answers it
    assert float(getattr(optimizer, SERIAL_NORM)(gradients, params, float("inf"))) == pytest.approx(
        max(float(g.abs().max()) for g in counted)
    )


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_gradient_gives_deepspeeds_invalid_norm(bad):
    eng = zero_engine(1)
    assert fuse_grad_norm(eng)
    gradients, params = boundary_gradients(eng)
    gradients_held(eng.optimizer)[5].view(-1)[2] = bad
    fused = getattr(eng.optimizer, SERIAL_NORM)(gradients, params)
    assert float(fused) == -1.0 == float(per_tensor_norm(eng.optimizer, gradients, params))


def test_clipped_training_moves_the_weights_as_deepspeeds_norm_does():
    """Three steps clipped hard (every step's norm is above 0.05), once with each norm: the same norms every step, and
    the same fp32 master weights after the first. (Later steps start from bf16 weights in which a rounding may have
    flipped, so they are compared by their norms.)"""
    batches = shakespeare_batches(3)
    norms, first_masters = [], []
    for fused in (False, True):
        eng = zero_engine(1, clipping=0.05, gradient_accumulation_steps=1)
        assert not fused or fuse_grad_norm(eng)
        master = eng.optimizer.single_partition_of_fp32_groups[0]
        initial = master.detach().clone()
        step_norms = []
        for ids in batches:
            step(eng, ids)
            step_norms.append(float(eng.get_global_grad_norm()))
            if len(step_norms) == 1:
                first_masters.append(master.detach().clone())
        assert min(step_norms) > 0.05
        norms.append(step_norms)
    update = (first_masters[0] - initial).abs().max()
    assert update > 1e-4  # it trained
    assert norms[1] == pytest.approx(norms[0], rel=1e-4)
    assert (first_masters[0] - first_masters[1]).abs().max() < 1e-4 * update  # measured: 7.5e-9 of an update of 1e-3


@pytest.mark.parametrize("stage", [0, 3])
def test_engines_without_the_per_tensor_norm_are_left_alone(stage):
    eng = engine(tiny_llama(), Precision(compute="fp32", loss_chunk_tokens=16), {"zero_optimization": {"stage": stage}})
    assert not fuse_grad_norm(eng)
