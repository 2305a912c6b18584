"""checkpointing.mlp_tiles in the plan: a long sequence's peak drops by about the MLP's intermediates, auto turns the
tiles on where the layers with their inputs on the host would not fit, and the levers that refuse them are kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from memtrain.errors import RecipeError
from memtrain.plan.activations import tiled_mlp_trace, trace_layer
from memtrain.plan.advice import advise
from memtrain.plan.planner import plan_recipe, resolve_checkpointing
from memtrain.recipe.load import load_recipe

GiB = 1024**3
QWEN = Path(__file__).resolve().parents[2] / "recipes/qwen2.5-7b-lora-long-24gb.yaml"
EVERY_LAYER = ["checkpointing.strategy=every_layer", "checkpointing.offload_inputs=true"]
# checkpointing as auto chooses it from nothing (the shipped recipe sets every_layer, inputs on host and tiles)
AUTO_UNTILED = ["checkpointing.strategy=auto", "checkpointing.offload_inputs=false", "checkpointing.mlp_tiles=0"]
INTERMEDIATE = 32768 * 18944 * 2  # one of Qwen2.5-7B's MLP intermediates at 32,768 tokens in bf16: 1.16 GiB


def plan(*overrides: str):
    return plan_recipe(load_recipe(QWEN, list(overrides)).recipe)


def test_tiles_drop_the_peak_by_about_the_mlp_intermediates():
    """Untiled, the recomputed layer keeps gate, up and down_proj's input (Liger's SwiGLU keeps no activation
    output) and backward adds one intermediate's gradient: four intermediates; tiled, the MLP keeps its input
    and one of ten tiles' share comes back in backward."""
    untiled = plan(*EVERY_LAYER, "checkpointing.mlp_tiles=0")
    tiled = plan(*EVERY_LAYER, "checkpointing.mlp_tiles=auto")
    drop = untiled.peak_allocated_bytes - tiled.peak_allocated_bytes
    assert 3.0 * INTERMEDIATE < drop < 4.0 * INTERMEDIATE
    assert tiled.checkpointing == "every_layer + inputs on host + MLP in auto tiles"
    # only the activations (and the allocator slack on them) change: model states, loss and host inputs stay
    assert {k: v for k, v in tiled.terms.items() if k not in ("activations", "allocator_slack")} == {
        k: v for k, v in untiled.terms.items() if k not in ("activations", "allocator_slack")
    }
    assert tiled.host_breakdown == untiled.host_breakdown
    # more tiles, less memory; one tile keeps only the input too, with the whole MLP back in backward
    two, ten = plan(*EVERY_LAYER, "checkpointing.mlp_tiles=2"), plan(*EVERY_LAYER, "checkpointing.mlp_tiles=10")
    assert ten.peak_allocated_bytes == tiled.peak_allocated_bytes  # auto: ceil(32768 / 3584) = 10 tiles
    assert untiled.peak_allocated_bytes > two.peak_allocated_bytes > ten.peak_allocated_bytes


def test_a_tiled_trace_keeps_the_mlp_input_and_one_tile_comes_back():
    recipe = load_recipe(QWEN).recipe
    trace = trace_layer(recipe.model, "bf16", 1, 4096)
    tiled, tile_bytes = tiled_mlp_trace(trace, 4)
    mlp_input = trace.inputs["mlp"][1]
    assert tiled.block_bytes("mlp") == mlp_input
    assert tiled.full_bytes == trace.full_bytes - trace.block_bytes("mlp") + mlp_input
    assert tile_bytes == -(-trace.block_bytes("mlp") // 4) + 2 * -(-(4096 * 18944 * 2) // 4)
    assert tiled_mlp_trace(trace, 0) == (trace, 0)


def test_auto_turns_the_tiles_on_where_the_inputs_on_the_host_are_not_enough():
    at_32k = plan(*AUTO_UNTILED)
    assert at_32k.inputs_on_host and at_32k.mlp_tiles == 0  # fits comfortably without them
    recipe = load_recipe(QWEN, [*AUTO_UNTILED, "data.seq_len=65536"]).recipe
    at_64k = plan_recipe(recipe)
    assert at_64k.fits and not at_64k.tight and at_64k.inputs_on_host and at_64k.mlp_tiles == "auto"
    resolved = resolve_checkpointing(recipe, micro_batch=1).checkpointing
    assert (resolved.strategy, resolved.offload_inputs, resolved.mlp_tiles) == ("first_n_layers", True, "auto")
    assert resolved.first_n_layers == at_64k.recomputed_layers
    # without tiles the same search at 64k does not fit comfortably
    host_only = plan(*AUTO_UNTILED, "checkpointing.offload_inputs=true", "data.seq_len=65536")
    assert not (host_only.fits and not host_only.tight)


def test_auto_leaves_the_tiles_off_where_the_optimizer_steps_in_backward():
    """The recipe checks refuse the pair (the per-parameter hooks would fire once per tile): auto does not make it."""
    recipe = load_recipe(QWEN, [*AUTO_UNTILED, "data.seq_len=65536"]).recipe
    in_backward = recipe.model_copy(
        update={"optimizer": recipe.optimizer.model_copy(update={"step_in_backward": True})}
    )
    assert plan_recipe(in_backward).mlp_tiles == 0


def test_fit_offers_tiles_for_a_long_sequence_that_misses():
    loaded = load_recipe(QWEN, [*EVERY_LAYER, "checkpointing.mlp_tiles=0", "hardware.gpu=21GiB"])
    assert not plan_recipe(loaded.recipe).fits
    advice = advise(loaded, limit=1)
    assert advice[0].overrides == ["checkpointing.mlp_tiles=auto"] and advice[0].speed_cost == 0.1
    assert advice[0].plan.fits and not advice[0].tight


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        (["train.compile=true", "checkpointing.mlp_tiles=4"], "train.compile", "tiled"),
        (
            [
                "checkpointing.mlp_tiles=4",
                "optimizer.step_in_backward=true",
                "optimizer.grad_clip=0",
                "offload.zero_stage=0",
                "precision.master=bf16",
                "batch.micro_batch=4",
                "batch.policy=fixed",
            ],
            "checkpointing.mlp_tiles",
            "first tile",
        ),
        (["checkpointing.mlp_tiles=-1"], "checkpointing.mlp_tiles", "must be at least 0 or 'auto', got -1"),
        (["checkpointing.mlp_tiles=many"], "checkpointing.mlp_tiles", "must be a whole number or 'auto', got 'many'"),
    ],
)
def test_combinations_and_values_that_cannot_tile_are_refused(overrides, key, says):
    with pytest.raises(RecipeError) as error:
        load_recipe(QWEN, [*EVERY_LAYER, *overrides])
    problems = [p for p in error.value.problems if p.key == key]
    assert problems, [p.key for p in error.value.problems]
    assert says in problems[0].message


def test_a_bad_tile_count_in_a_recipe_file_stops_the_cli_with_exit_2_and_the_line(tmp_path):
    from typer.testing import CliRunner

    from memtrain.cli import app

    text = QWEN.read_text().replace("  mlp_tiles: auto ", "  mlp_tiles: lots ")
    assert "mlp_tiles: lots" in text
    (tmp_path / "bad.yaml").write_text(text)
    result = CliRunner().invoke(app, ["validate", str(tmp_path / "bad.yaml")])
    assert result.exit_code == 2, result.output
    line = next(i for i, row in enumerate(text.splitlines(), 1) if "mlp_tiles: lots" in row)
    assert f"bad.yaml:{line}" in result.output and "checkpointing.mlp_tiles" in result.output
    assert "must be a whole number or 'auto', got 'lots'" in result.output and "Traceback" not in result.output
