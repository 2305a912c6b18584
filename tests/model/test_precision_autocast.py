"""precision.mode: autocast — fp32 weights everywhere (fp32_modules included, also under DeepSpeed),
nn.Linear computed in bf16 by DeepSpeed's torch_autocast, the loss within bf16 tolerance of fp32."""

from __future__ import annotations

import os

import pytest
import torch

from memtrain.ds_config.compiler import ds_config
from memtrain.errors import RecipeError
from memtrain.model.build import build_model
from memtrain.model.precision import apply_precision
from memtrain.model.wrapper import TrainableLM
from memtrain.recipe.load import load_recipe_text

RECIPE = """
model: {preset: micro}
data: {train: "builtin:shakespeare", seq_len: 32}
precision: {compute: bf16, mode: autocast, fp32_modules: ["*norm*"]}
batch: {global_batch: 4, micro_batch: 4}
train: {steps: 10}
"""


def _engine(recipe_text: str, overrides: list[str]):
    import deepspeed

    from memtrain.train.runtime.distributed import free_port

    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    recipe = load_recipe_text(recipe_text, overrides=overrides).recipe
    config = ds_config(recipe, micro_batch=4)
    model = build_model(recipe.model, recipe.precision.storage, torch.device("cpu"), config, seed=0)
    apply_precision(model, recipe.precision)
    lm = TrainableLM(model, recipe.precision)
    engine, *_ = deepspeed.initialize(
        model=lm, model_parameters=[p for p in lm.parameters() if p.requires_grad], config=config
    )
    return engine, model


@pytest.mark.slow
def test_autocast_keeps_fp32_weights_runs_linear_in_bf16_and_matches_fp32():
    torch.manual_seed(0)
    tokens = torch.randint(0, 4096, (4, 32))
    engine, model = _engine(RECIPE, [])
    assert {p.dtype for p in engine.module.parameters()} == {torch.float32}  # norms too, after initialize
    seen = {}
    q_proj = model.model.layers[0].self_attn.q_proj
    norm = model.model.layers[0].input_layernorm

    def record(name, value):
        seen.setdefault(name, value)  # a forward hook must return None, or it replaces the output

    handles = [
        q_proj.register_forward_hook(lambda m, i, o: record("linear", o.dtype)),
        norm.register_forward_hook(lambda m, i, o: record("norm_weight", m.weight.dtype)),
    ]
    losses = []
    for _ in range(3):
        loss_sum, n_tokens = engine(input_ids=tokens, labels=tokens)
        engine.backward(loss_sum / n_tokens, scale_wrt_gas=False)
        engine.step()
        losses.append(float(loss_sum / n_tokens))
    for handle in handles:
        handle.remove()
    assert seen == {"linear": torch.bfloat16, "norm_weight": torch.float32}
    reference, _ = _engine(RECIPE, ["precision.mode=cast", "precision.compute=fp32", "precision.fp32_modules=[]"])
    with torch.no_grad():
        fp32_loss, fp32_tokens = reference(input_ids=tokens, labels=tokens)
    # the first loss (same initial weights) agrees with pure fp32 within bf16 resolution
    assert losses[0] == pytest.approx(float(fp32_loss / fp32_tokens), rel=2**-7)
    assert losses[2] < losses[0]


def test_autocast_compiles_to_deepspeed_torch_autocast_without_a_bf16_block():
    recipe = load_recipe_text(RECIPE).recipe
    config = ds_config(recipe, micro_batch=4)
    assert config["torch_autocast"] == {
        "enabled": True,
        "dtype": "bfloat16",
        "lower_precision_safe_modules": ["torch.nn.Linear"],
    }
    assert "bf16" not in config and "fp16" not in config


def test_autocast_plans_fp32_weights_and_gradients():
    from memtrain.plan.planner import plan_recipe

    autocast = plan_recipe(load_recipe_text(RECIPE).recipe)
    cast = plan_recipe(load_recipe_text(RECIPE, overrides=["precision.mode=cast"]).recipe)
    assert autocast.terms["params"] == 2 * cast.terms["params"]
    assert autocast.terms["gradients"] == 2 * cast.terms["gradients"]


@pytest.mark.parametrize(
    "overrides,key", [(["precision.compute=fp16"], "precision.mode"), (["precision.master=bf16"], "precision.master")]
)
def test_autocast_contradictions_are_recipe_errors(overrides, key):
    with pytest.raises(RecipeError) as error:
        load_recipe_text(RECIPE, overrides=overrides)
    assert any(problem.key == key for problem in error.value.problems)
