"""Lean LoRA dropout: the same dropout as PEFT's, with the mask regenerated from a seed in backward,
so autograd keeps the adapter input (shared by q/k/v) instead of a dropped copy and its mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memtrain.model.build import build_model
from memtrain.model.lora_dropout import DropoutLinear, LeanDropoutLinear, dropout_mask
from memtrain.model.recompute import apply_checkpointing
from memtrain.recipe.schema import Checkpointing, Lora, Model
from tests.conftest import lora_layer_saved_bytes, saved_for_backward_bytes
from tests.model.test_support import one_torch_thread  # noqa: F401 (autouse fixture)

CPU = torch.device("cpu")
MICRO = {"hidden": 64, "intermediate": 172, "layers": 2}  # configs/models/micro.yaml


def reference(x: torch.Tensor, weight: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """What the Function computes, through autograd: dropout with the seed's mask, then x @ A.T."""
    keep = dropout_mask(x.shape, p, seed, x.device)
    return F.linear(x * keep * (1 / (1 - p)), weight)


def grads(fn, x, weight, grad_h):
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    h = fn(x, weight)
    h.backward(grad_h)
    return h.detach(), x.grad, weight.grad


def inputs(dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)
        for shape in ((3, 10, 48), (8, 48), (3, 10, 8))
    )  # x, A, grad of h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_and_gradients_equal_autograd_through_the_same_mask(dtype):
    x, weight, grad_h = inputs(dtype)
    lean = grads(lambda x, w: DropoutLinear.apply(x, w, 0.3, 1234), x, weight, grad_h)
    ref = grads(lambda x, w: reference(x, w, 0.3, 1234), x, weight, grad_h)
    for got, want in zip(lean, ref):
        assert got.dtype == want.dtype == dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_gradcheck_in_float64():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: DropoutLinear.apply(x, w, 0.4, 7), (x, weight))


def test_autocast_multiplies_in_bf16_and_returns_gradients_in_the_weights_dtype():
    torch.manual_seed(0)
    x, weight, grad_h = torch.randn(4, 32), torch.randn(8, 32), torch.randn(4, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lean = grads(lambda x, w: DropoutLinear.apply(x, w, 0.2, 5), x, weight, grad_h)
        ref = grads(lambda x, w: reference(x, w, 0.2, 5), x, weight, grad_h)
    assert lean[0].dtype == torch.bfloat16 and lean[1].dtype == lean[2].dtype == torch.float32
    for got, want in zip(lean, ref):
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.05)


def test_a_seed_gives_one_mask_that_drops_about_p():
    p, n = 0.1, 1_000_000
    mask = dropout_mask((n,), p, 42, CPU)
    assert torch.equal(mask, dropout_mask((n,), p, 42, CPU))
    assert not torch.equal(mask, dropout_mask((n,), p, 43, CPU))
    # The dropped fraction has a standard deviation of sqrt(p(1-p)/n) = 0.0003: 0.005 is 16 of them.
    assert abs((~mask).float().mean().item() - p) < 0.005
    # Through the Function: an identity A shows the dropped input, zeros and survivors scaled by 1/(1-p).
    h = DropoutLinear.apply(torch.ones(4000, 64), torch.eye(64), p, 42)
    assert abs((h == 0).float().mean().item() - p) < 0.005
    assert torch.allclose(h[h != 0], torch.tensor(1 / (1 - p)))


def lora_model(dropout: float, lean: bool, targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "down_proj")):
    """The micro preset with LoRA through memtrain's build path (fp32, training mode), B made non-zero
    so that A's gradients are too; the same weights for lean and PEFT's dropout."""
    model = Model(preset="micro", lora=Lora(r=4, dropout=dropout, lean_dropout=lean, target_modules=list(targets)))
    lm = build_model(model, "fp32", CPU, seed=3)
    generator = torch.Generator().manual_seed(5)
    for name, param in lm.named_parameters():
        if "lora_B" in name:
            param.data.normal_(std=0.1, generator=generator)
    return lm.train()


def step(lm, seed: int = 11):
    """Loss and adapter gradients of one forward/backward on fixed tokens, dropout seeded by `seed`."""
    ids = torch.randint(4096, (2, 32), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(seed)
    loss = lm(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in lm.named_parameters() if p.grad is not None}


def test_without_dropout_the_flag_changes_nothing():
    lean, plain = lora_model(0.0, True), lora_model(0.0, False)
    assert not any(isinstance(m, LeanDropoutLinear) for m in lean.modules())
    (lean_loss, lean_grads), (plain_loss, plain_grads) = step(lean), step(plain)
    assert torch.equal(lean_loss, plain_loss)
    assert lean_grads.keys() == plain_grads.keys() and len(lean_grads) == 2 * 4 * MICRO["layers"]
    assert all(torch.equal(lean_grads[n], plain_grads[n]) for n in plain_grads)


def test_eval_outputs_and_the_state_dict_are_peft_s():
    lean, plain = lora_model(0.1, True), lora_model(0.1, False)
    assert sum(isinstance(m, LeanDropoutLinear) for m in lean.modules()) == 4 * MICRO["layers"]
    assert list(lean.state_dict()) == list(plain.state_dict())
    from peft import get_peft_model_state_dict

    lean_adapter, plain_adapter = get_peft_model_state_dict(lean), get_peft_model_state_dict(plain)
    assert lean_adapter.keys() == plain_adapter.keys()
    assert all(torch.equal(lean_adapter[k], plain_adapter[k]) for k in plain_adapter)
    ids = torch.randint(4096, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(lean.eval()(input_ids=ids).logits, plain.eval()(input_ids=ids).logits)
    # In training the dropout is real: two seeds, two different losses.
    assert not torch.equal(step(lean.train(), seed=1)[0], step(lean, seed=2)[0])


def test_peft_s_bitsandbytes_4bit_layer_goes_through_the_lean_path():
    """A model loaded in 4 bits gets PEFT's bnb.Linear4bit wrapper, whose forward calls
    lora_A(dropout(x)) as the plain one does; memtrain's quantised presets get the plain wrapper."""
    pytest.importorskip("bitsandbytes")
    from peft.tuners.lora.bnb import Linear4bit

    from memtrain.model.build import add_lora

    model = Model(preset="micro", quantize={"type": "nf4"}, lora=Lora(r=4, dropout=0.1, lean_dropout=True))
    lm = build_model(model.model_copy(update={"lora": None}), "bf16", CPU)
    lm.is_loaded_in_4bit = True  # what from_pretrained sets with a 4-bit quantization_config
    lm = add_lora(lm, model).train()
    wrapped = [m for m in lm.modules() if isinstance(m, Linear4bit)]
    assert len(wrapped) == 7 * MICRO["layers"]
    assert all(isinstance(m.lora_A["default"], LeanDropoutLinear) for m in wrapped)
    calls = []
    for m in wrapped:
        m.lora_A["default"].register_forward_hook(lambda *_: calls.append(1))
    loss, grads = step(lm)
    assert len(calls) == len(wrapped) and torch.isfinite(loss)
    assert sum("lora_A" in n for n in grads) == len(wrapped)


def saved_bytes(lm) -> int:
    """Bytes autograd keeps for backward in one forward (unique storages, parameters left out)."""
    ids = torch.randint(4096, (2, 32), generator=torch.Generator().manual_seed(0))
    return saved_for_backward_bytes(lambda: lm(input_ids=ids, labels=ids), skip=lm.parameters())


def test_training_keeps_one_input_per_shared_adapter_input_instead_of_dropped_copies_and_masks():
    tokens, fp32 = 2 * 32, 4
    hidden, intermediate = MICRO["hidden"], MICRO["intermediate"]
    # PEFT: each of q, k, v, down keeps a dropped copy and the CPU mask (input dtype), 2 × in bytes each.
    plain = 2 * fp32 * tokens * (3 * hidden + intermediate)
    # Lean: the norm output that q, k, v share, and down_proj's input; nothing else keeps either.
    lean = fp32 * tokens * (hidden + intermediate)
    saving = saved_bytes(lora_model(0.1, False)) - saved_bytes(lora_model(0.1, True))
    assert saving == MICRO["layers"] * (plain - lean)


@pytest.mark.parametrize("strategy", ["every_layer", "selective"])
def test_recompute_regenerates_the_same_masks(strategy):
    """Checkpointing restores the CPU generator before a recompute, so the seeds, and masks, repeat."""
    loss, reference_grads = step(lora_model(0.1, True))
    lm = lora_model(0.1, True)
    apply_checkpointing(lm, Checkpointing(strategy=strategy))
    calls = []
    for module in lm.modules():
        if isinstance(module, LeanDropoutLinear):
            module.register_forward_hook(lambda *_: calls.append(1))
    checkpointed_loss, grads = step(lm)
    assert len(calls) == 2 * 4 * MICRO["layers"]  # every adapter ran again in backward
    assert torch.equal(checkpointed_loss, loss)
    assert grads.keys() == reference_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], rtol=0, atol=1e-7, msg=name)
    other_seed = step(lora_model(0.1, True), seed=12)[1]
    assert not all(torch.allclose(other_seed[n], g) for n, g in reference_grads.items() if "lora_A" in n)


def test_the_plan_prices_lean_dropout_as_what_the_layer_saves():
    """The trace of a lean LoRA layer equals the real layer's saved bytes on the CPU (no mask to price
    differently), and is below PEFT's dropout by the dropped copies and masks less the shared inputs."""
    from memtrain.plan.activations import trace_layer

    targets = ["q_proj", "v_proj", "down_proj"]
    model = Model(preset="tiny", lora={"r": 8, "target_modules": targets, "lean_dropout": True})
    assert model.lora.lean_dropout and model.lora.dropout > 0
    tokens, hidden, intermediate = 2 * 32, 256, 688
    trace = trace_layer(model, "bf16", 2, 32)
    peft = trace_layer(
        model.model_copy(update={"lora": model.lora.model_copy(update={"lean_dropout": False})}), "bf16", 2, 32
    )
    # PEFT: a bf16 dropped copy and a one-byte CUDA mask per adapter; lean: q/v's shared input and down's.
    assert peft.full_bytes - trace.full_bytes == tokens * (
        3 * (hidden + hidden + intermediate) - 2 * (hidden + intermediate)
    )

    assert trace.full_bytes == lora_layer_saved_bytes(model, 2, 32)
