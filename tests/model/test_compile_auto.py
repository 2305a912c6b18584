"""train.compile: auto — which recipes compile their decoder layers on a CUDA GPU, and that the rest do not."""

from __future__ import annotations

from pathlib import Path

import pytest

from memtrain.model.compiled import resolve_compile
from memtrain.recipe.load import load_recipe

ROOT = Path(__file__).resolve().parents[2]
LORA = ROOT / "recipes/llama2-7b-lora-24gb.yaml"
# the rules of auto for layers a checkpoint recomputes whole; the recipe's memory_budget compiles wherever it can
# (tests/model/test_memory_budget.py)
WHOLE = "checkpointing.strategy=every_layer"


def resolved(recipe: Path, *overrides: str, cuda: bool = True) -> bool:
    overrides = (WHOLE, *overrides) if recipe == LORA else overrides
    return resolve_compile(load_recipe(recipe, list(overrides)).recipe, cuda)


def test_auto_compiles_llama_lora_on_a_cuda_gpu_only():
    assert resolved(LORA)
    assert not resolved(LORA, cuda=False)


@pytest.mark.parametrize(
    "overrides, why",
    [
        (("model.lora.lean_dropout=true",), "lean dropout's autograd function is not fused: slower compiled"),
        (("model.preset=gemma2-9b",), "a family not measured compiled"),
        (("offload.optimizer=cpu", "offload.params=cpu"), "ZeRO-3 gathers weights in hooks compile would trace"),
    ],
)
def test_auto_leaves_eager_what_was_not_measured_to_win(overrides, why):
    assert not resolved(LORA, *overrides), why


def test_auto_leaves_full_fine_tunes_and_quantised_bases_eager():
    assert not resolved(ROOT / "recipes/tinyllama-1.1b-full-offload-24gb.yaml")
    assert not resolved(ROOT / "recipes/llama2-7b-qlora-16gb.yaml")


def test_true_and_false_stand_as_written():
    assert resolved(ROOT / "recipes/tinyllama-1.1b-full-offload-24gb.yaml", "train.compile=true")
    assert not resolved(LORA, "train.compile=false")
    assert resolved(LORA, "train.compile=true", cuda=False)  # asked for: compiled on the CPU too (the tests do)


def test_auto_compiles_the_other_measured_families():
    assert resolved(LORA, "model.preset=mistral-7b-v0.3") and resolved(LORA, "model.preset=qwen2.5-7b")


def test_compiled_layers_on_a_quantised_base_are_refused_with_the_reason(tmp_path):
    from memtrain.errors import RecipeError

    with pytest.raises(RecipeError) as caught:
        load_recipe(ROOT / "recipes/llama2-7b-qlora-16gb.yaml", ["train.compile=true"])
    text = str(caught.value)
    assert "train.compile" in text and "quantised" in text and "train.compile=false" in text


def test_the_plan_prices_the_compiled_recompute_on_top_of_the_eager_layer():
    """Compiled layers' backward holds half a layer's eager keeps more (fitted on two 7B LoRA runs)."""
    from memtrain.plan.activations import COMPILED_RECOMPUTE_SHARE, trace_layer
    from memtrain.plan.planner import plan_recipe

    eager = plan_recipe(load_recipe(LORA, [WHOLE, "train.compile=false"]).recipe)
    compiled = plan_recipe(load_recipe(LORA, [WHOLE, "train.compile=true"]).recipe)
    auto = plan_recipe(load_recipe(LORA, [WHOLE]).recipe)  # what the run on a GPU does
    layer = trace_layer(load_recipe(LORA).recipe.model, "bf16", 4, 1024).full_bytes
    assert compiled.activations - eager.activations == int(COMPILED_RECOMPUTE_SHARE * layer)
    assert auto.activations == compiled.activations
    assert compiled.peak_reserved_bytes > eager.peak_reserved_bytes
    assert auto.compiled_layers and not eager.compiled_layers  # the plan's title says so


def test_the_plan_command_names_compiled_layers(tmp_path):
    import io

    from rich.console import Console

    from memtrain.commands.plan import plan_command

    def printed(*overrides):
        console = Console(file=io.StringIO(), width=300, color_system=None)
        assert (
            plan_command(LORA, [WHOLE, *overrides], console=console, gpu=None, fit=False, output=None, as_json=False)
            == 0
        )
        return " ".join(console.file.getvalue().split())  # the title wraps at the table's width

    assert "checkpointing every_layer, compiled layers" in printed()
    assert "compiled layers" not in printed("train.compile=false")
