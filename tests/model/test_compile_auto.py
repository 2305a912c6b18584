"""train.compile: auto — which recipes compile their decoder layers on a CUDA GPU, and that the rest do not."""
from __future__ import annotations

from pathlib import Path

import pytest

from memtrain.model.compiled import resolve_compile
from memtrain.recipe.load import load_recipe

ROOT = Path(__file__).resolve().parents[2]
LORA = ROOT / "recipes/llama2-7b-lora-24gb.yaml"


def resolved(recipe: Path, *overrides: str, cuda: bool = True) -> bool:
    return resolve_compile(load_recipe(recipe, list(overrides)).recipe, cuda)


def test_auto_compiles_llama_lora_on_a_cuda_gpu_only():
    assert resolved(LORA)
    assert not resolved(LORA, cuda=False)


@pytest.mark.parametrize("overrides, why", [
    (("model.lora.lean_dropout=true",), "lean dropout's autograd function is not fused: slower compiled"),
    (("model.preset=qwen2.5-7b",), "a family not measured compiled"),
    (("offload.optimizer=cpu", "offload.params=cpu"), "ZeRO-3 gathers weights in hooks compile would trace"),
])
def test_auto_leaves_eager_what_was_not_measured_to_win(overrides, why):
    assert not resolved(LORA, *overrides), why


def test_auto_leaves_full_fine_tunes_and_quantised_bases_eager():
    assert not resolved(ROOT / "recipes/tinyllama-1.1b-full-offload-24gb.yaml")
    assert not resolved(ROOT / "recipes/llama2-7b-qlora-16gb.yaml")


def test_true_and_false_stand_as_written():
    assert resolved(ROOT / "recipes/tinyllama-1.1b-full-offload-24gb.yaml", "train.compile=true")
    assert not resolved(LORA, "train.compile=false")
    assert resolved(LORA, "train.compile=true", cuda=False)  # asked for: compiled on the CPU too (the tests do)
