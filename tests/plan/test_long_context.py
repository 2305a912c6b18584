"""Long sequences: checkpointing auto moves the recomputed layers' inputs to pinned host memory when they would
not fit the card, the plan prices them on the host, and the two long-context recipes fit 24 GiB and 32 GiB of host."""

from __future__ import annotations

from pathlib import Path

import pytest

from memtrain.errors import RecipeError
from memtrain.model.config import model_config
from memtrain.plan.activations import trace_layer
from memtrain.plan.planner import plan_recipe, resolve_checkpointing
from memtrain.recipe.load import load_recipe
from memtrain.recipe.rules import check_rules

GiB = 1024**3
RECIPES = Path(__file__).resolve().parents[2] / "recipes"
LONG = {"llama3-8b-qlora-long-24gb.yaml": 65536, "qwen2.5-7b-lora-long-24gb.yaml": 32768}


@pytest.mark.parametrize("name", list(LONG))
def test_the_long_recipes_fit_24gib_with_the_layer_inputs_on_a_32gib_host(name):
    loaded = load_recipe(RECIPES / name)
    recipe = loaded.recipe
    assert recipe.data.seq_len == LONG[name] and recipe.data.packing
    assert not check_rules(loaded)
    plan = plan_recipe(recipe)
    assert plan.fits and not plan.tight and plan.gpu_capacity_bytes == 24 * GiB
    assert plan.host_capacity_bytes == 32 * GiB and plan.host_bytes < 32 * GiB
    assert plan.inputs_on_host and "+ inputs on host" in plan.checkpointing
    # one pinned bf16 input of seq_len x hidden per recomputed layer (exact size: the run sets the rounding threshold)
    hidden = model_config(recipe.model).hidden_size
    assert plan.host_breakdown["offloaded_layer_inputs"] == plan.recomputed_layers * LONG[name] * hidden * 2
    # kept on the GPU instead, the same inputs would not fit
    on_gpu = plan_recipe(resolve_checkpointing(recipe, 1).model_copy(update={"checkpointing": _on_gpu(recipe)}))
    assert not on_gpu.fits
    assert on_gpu.peak_reserved_bytes - plan.peak_reserved_bytes >= 0.9 * plan.host_breakdown["offloaded_layer_inputs"]


def _on_gpu(recipe):
    resolved = resolve_checkpointing(recipe, 1).checkpointing
    return resolved.model_copy(update={"offload_inputs": False})


def test_auto_keeps_the_inputs_on_the_gpu_where_they_fit():
    recipe = load_recipe(RECIPES / "llama3-8b-qlora-long-24gb.yaml", ["data.seq_len=4096"]).recipe
    plan = plan_recipe(recipe)
    assert plan.fits and not plan.inputs_on_host and plan.host_breakdown["offloaded_layer_inputs"] == 0


def test_resolved_auto_carries_the_inputs_on_host_to_the_run():
    recipe = load_recipe(
        RECIPES / "qwen2.5-7b-lora-long-24gb.yaml",
        ["checkpointing.strategy=auto", "checkpointing.offload_inputs=false", "checkpointing.mlp_tiles=0"],
    ).recipe
    plan = plan_recipe(recipe)
    resolved = resolve_checkpointing(recipe, micro_batch=1).checkpointing
    assert (resolved.strategy, resolved.first_n_layers, resolved.offload_inputs) == (
        "first_n_layers",
        plan.recomputed_layers,
        True,
    )
    assert plan_recipe(resolve_checkpointing(recipe, 1)).peak_reserved_bytes == plan.peak_reserved_bytes


def test_a_host_too_small_for_the_inputs_is_not_given_them():
    recipe = load_recipe(RECIPES / "llama3-8b-qlora-long-24gb.yaml", ["hardware.host_memory=8GiB"]).recipe
    plan = plan_recipe(recipe)
    assert not plan.fits and not plan.inputs_on_host


def test_inputs_on_host_leave_the_gpu_and_one_comes_back_for_backward():
    base = load_recipe(RECIPES / "llama3-8b-qlora-long-24gb.yaml", ["checkpointing.strategy=every_layer"]).recipe
    on_host = load_recipe(
        RECIPES / "llama3-8b-qlora-long-24gb.yaml",
        ["checkpointing.strategy=every_layer", "checkpointing.offload_inputs=true"],
    ).recipe
    a, b = plan_recipe(base), plan_recipe(on_host)
    layer_input = trace_layer(base.model, "bf16", 1, 65536).layer_input_bytes
    assert layer_input == 65536 * 4096 * 2
    assert a.saved_for_backward["layers"] - b.saved_for_backward["layers"] == 32 * layer_input
    assert b.terms["activations"] == a.terms["activations"] - 31 * layer_input  # one input back in backward
    assert b.host_breakdown["offloaded_layer_inputs"] == 32 * layer_input


@pytest.mark.parametrize("strategy", ["none", "selective"])
def test_offload_inputs_needs_a_strategy_that_recomputes_whole_layers(strategy):
    with pytest.raises(RecipeError) as error:
        load_recipe(
            RECIPES / "llama3-8b-qlora-long-24gb.yaml",
            [f"checkpointing.strategy={strategy}", "checkpointing.offload_inputs=true"],
        )
    assert [p.key for p in error.value.problems] == ["checkpointing.offload_inputs"]
    assert "recomputes no whole layers" in error.value.problems[0].message


def test_offload_inputs_refuses_compiled_layers_and_auto_does_not_offer_it_to_them():
    untiled = ["checkpointing.mlp_tiles=0"]
    with pytest.raises(RecipeError) as error:
        load_recipe(
            RECIPES / "qwen2.5-7b-lora-long-24gb.yaml",
            [*untiled, "train.compile=true", "checkpointing.offload_inputs=true"],
        )
    assert [p.key for p in error.value.problems] == ["train.compile"]
    compiled = load_recipe(
        RECIPES / "qwen2.5-7b-lora-long-24gb.yaml",
        [*untiled, "train.compile=true", "checkpointing.strategy=auto", "checkpointing.offload_inputs=false"],
    ).recipe
    plan = plan_recipe(compiled)
    assert plan.compiled_layers and not plan.inputs_on_host and not plan.fits


def test_fit_offers_the_layer_inputs_on_the_host_for_a_long_sequence_that_misses():
    """Every layer recomputed with its input kept on the GPU: 16 GiB of inputs at 65,536 tokens, the card misses;
    the cheapest change that fits moves them to the host (+15 %), before the slower levers."""
    from memtrain.plan.advice import advise

    loaded = load_recipe(RECIPES / "llama3-8b-qlora-long-24gb.yaml", ["checkpointing.strategy=every_layer"])
    assert not plan_recipe(loaded.recipe).fits
    advice = advise(loaded, limit=1)
    assert advice[0].overrides == ["checkpointing.offload_inputs=true"] and advice[0].speed_cost == 0.15
    assert advice[0].plan.fits and advice[0].plan.inputs_on_host and not advice[0].tight
