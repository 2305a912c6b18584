"""DoRA, rsLoRA, LoRA+ and modules_to_save through PEFT: each trains, each is counted, LoRA+ groups are exact."""

from __future__ import annotations

import math

import pytest
import torch

from memtrain.errors import UserError
from memtrain.model.build import build_model
from memtrain.model.loraplus import lora_param_groups
from memtrain.model.wrapper import TrainableLM
from memtrain.plan.params import count_parameters
from memtrain.recipe.schema import Lora, Model, Precision

VARIANTS = {
    "lora": {},
    "dora": {"use_dora": True},
    "rslora": {"use_rslora": True},
    "loraplus": {"loraplus_lr_ratio": 16.0},
    "modules_to_save": {"modules_to_save": ["embed_tokens", "lm_head"]},
}


def _model(**lora) -> Model:
    return Model(preset="micro", lora=Lora(r=4, alpha=8, dropout=0.0, **lora))


def _lm(model: Model) -> torch.nn.Module:
    return build_model(model, "fp32", torch.device("cpu"), seed=3)


def _step(lm: torch.nn.Module, lora: Lora, input_ids: torch.Tensor) -> float:
    """One AdamW step on the memtrain loss; returns the loss before it."""
    groups = lora_param_groups(lm, lr=1e-2, ratio=lora.loraplus_lr_ratio, weight_decay=0.0)
    optimizer = torch.optim.AdamW(groups)
    loss_sum, n_tokens = TrainableLM(lm, Precision(compute="fp32"))(input_ids, input_ids)
    loss = loss_sum / n_tokens
    loss.backward()
    optimizer.step()
    return loss.item()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_variant_trains_a_step_and_only_its_trainable_weights_move(variant):
    model = _model(**VARIANTS[variant])
    lm = _lm(model)
    before = {name: p.detach().clone() for name, p in lm.named_parameters()}
    input_ids = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(0))
    first = _step(lm, model.lora, input_ids)
    with torch.no_grad():
        loss_sum, n_tokens = TrainableLM(lm, Precision(compute="fp32"))(input_ids, input_ids)
    assert math.isfinite(first) and (loss_sum / n_tokens).item() < first
    moved = {name for name, p in lm.named_parameters() if not torch.equal(p, before[name])}
    trainable = {name for name, p in lm.named_parameters() if p.requires_grad}
    assert moved and moved <= trainable
    # B starts at zero, so A gets no gradient in the first step; B does
    assert any(".lora_B." in name for name in moved)
    # the planner's count is PEFT's, variant by variant
    counts = count_parameters(model)
    assert counts.trainable == sum(p.numel() for p in lm.parameters() if p.requires_grad)
    assert counts.total == sum(p.numel() for p in lm.parameters())


def test_the_variants_reach_peft():
    dora = _lm(_model(use_dora=True))
    magnitudes = [n for n, p in dora.named_parameters() if "lora_magnitude_vector" in n and p.requires_grad]
    assert len(magnitudes) == 2 * 7  # one per adapted module: 7 projections in each of 2 layers
    rs = _lm(_model(use_rslora=True)).base_model.model.model.layers[0].self_attn.q_proj
    assert rs.scaling["default"] == pytest.approx(8 / math.sqrt(4))  # alpha / sqrt(r), not alpha / r = 2
    saved = _lm(_model(modules_to_save=["lm_head"]))
    assert saved.base_model.model.lm_head.modules_to_save["default"].weight.requires_grad


def test_loraplus_puts_exactly_the_b_matrices_in_the_fast_group():
    lm = _lm(_model(use_dora=True, modules_to_save=["lm_head"], loraplus_lr_ratio=16.0))
    base, fast = lora_param_groups(lm, lr=2e-4, ratio=16.0, weight_decay=0.1)
    names = {id(p): n for n, p in lm.named_parameters()}
    fast_names = {names[id(p)] for p in fast["params"]}
    b_weights = {n for n, p in lm.named_parameters() if ".lora_B." in n}
    assert fast_names == b_weights and len(b_weights) == 14
    assert fast["lr"] == pytest.approx(2e-4 * 16) and base["lr"] == 2e-4
    assert base["weight_decay"] == fast["weight_decay"] == 0.1
    base_names = {names[id(p)] for p in base["params"]}
    assert base_names | fast_names == {n for n, p in lm.named_parameters() if p.requires_grad}
    assert any("lora_magnitude_vector" in n for n in base_names) and any("modules_to_save" in n for n in base_names)
    # without LoRA+ (or LoRA) everything trainable is one group
    (single,) = lora_param_groups(lm, lr=2e-4, ratio=None, weight_decay=0.0)
    assert len(single["params"]) == len(base["params"]) + len(fast["params"])


def test_modules_to_save_that_the_model_lacks_are_named_with_the_ones_it_has():
    with pytest.raises(UserError) as caught:
        _lm(_model(modules_to_save=["wte"]))
    problem = caught.value.problems[0]
    assert problem.key == "model.lora.modules_to_save" and "wte" in problem.message
    assert "embed_tokens" in problem.hint and "lm_head" in problem.hint
