"""Optimizer states on NVMe need ZeRO-3: DeepSpeed's ZeRO-1/2 optimizer has no NVMe swapper and keeps states
offloaded to any device in host memory (stage_1_and_2.py), so `auto` picks stage 3 for them and an explicit
lower stage is refused where it is written, with the change that works."""

from __future__ import annotations

import pytest

from memtrain.errors import RecipeError
from memtrain.recipe.load import load_recipe_text

NVME = """\
model: {preset: tiny}
data: {train: "builtin:shakespeare", seq_len: 64}
hardware: {nvme_path: /tmp}
train: {steps: 10}
offload:
  optimizer: nvme
"""


def test_auto_stage_is_three_for_optimizer_states_on_nvme():
    assert load_recipe_text(NVME).recipe.zero_stage == 3
    assert load_recipe_text(NVME, overrides=["offload.optimizer=cpu"]).recipe.zero_stage == 2


@pytest.mark.parametrize("stage", [1, 2])
def test_explicit_stage_below_three_with_optimizer_on_nvme_is_refused_at_its_line(stage):
    with pytest.raises(RecipeError) as refused:
        load_recipe_text(NVME + f"  zero_stage: {stage}\n", "r.yaml")
    [problem] = refused.value.problems
    assert (problem.key, problem.file, problem.line) == ("offload.zero_stage", "r.yaml", 7)
    assert "needs ZeRO stage 3" in problem.message and "host memory" in problem.message
    assert "offload.zero_stage=3" in problem.hint and f"offload.optimizer=cpu to stay at ZeRO-{stage}" in problem.hint


def test_stage_zero_with_optimizer_on_nvme_asks_for_stage_three_once():
    with pytest.raises(RecipeError) as refused:
        load_recipe_text(NVME + "  zero_stage: 0\n", "r.yaml")
    [problem] = refused.value.problems
    assert problem.key == "offload.zero_stage" and "ZeRO stage 3" in problem.message
    assert problem.hint == "set offload.zero_stage=3 (or auto)"


@pytest.mark.parametrize(
    "recipe",
    [
        "offload: {optimizer: cpu, zero_stage: 2}\nprecision: {compute: bf16, master: bf16}\n",
        "offload: {optimizer: cpu, params: cpu}\n",
    ],
    ids=["zero2-bf16-master", "zero3-cpu"],
)
def test_host_refusals_hint_names_an_nvme_change_that_validates(recipe):
    """`run` refuses a host too small for the plan and points at NVMe: what it names must be a recipe DeepSpeed
    runs with the states on disk, also from a recipe that pins ZeRO-2 or bf16 master weights."""
    from memtrain.train.runtime.preflight import NVME_OPTIMIZER

    base = "model: {preset: tiny}\ndata: {train: 'builtin:shakespeare', seq_len: 64}\ntrain: {steps: 10}\n"
    changed = load_recipe_text(base + recipe, overrides=[*NVME_OPTIMIZER, "hardware.nvme_path=/tmp"]).recipe
    assert changed.offload.optimizer == "nvme" and changed.zero_stage == 3


def test_changes_away_from_zero3_also_move_nvme_optimizer_states_to_the_cpu():
    """QLoRA and compiled layers need ZeRO-2, where NVMe optimizer states would stay on the host: the hints name
    offload.optimizer=cpu with the stage, and QLoRA's points at the line that made it ZeRO-3."""
    from memtrain.recipe.rules import check_rules

    qlora_text = NVME.replace("{preset: tiny}", "{preset: tiny, lora: {r: 8}, quantize: {type: nf4}}")
    qlora = load_recipe_text(qlora_text, "r.yaml", check=False)
    [problem] = [p for p in check_rules(qlora) if "ZeRO-3" in p.message]
    assert (problem.key, problem.line) == ("offload.optimizer", 6)
    assert "offload.optimizer=cpu and offload.zero_stage=auto" in problem.hint
    compiled = load_recipe_text(NVME + "  zero_stage: 3\n", "r.yaml", overrides=["train.compile=true"], check=False)
    [problem] = [p for p in check_rules(compiled) if p.key == "train.compile"]
    assert "offload.optimizer=cpu and offload.zero_stage=2" in problem.hint


ONE_GPU = """\
model: {preset: tiny}
data: {train: "builtin:shakespeare", seq_len: 64}
train: {steps: 10}
offload:
  zero_stage: 0
"""


def test_stage_zero_with_bf16_weights_is_refused_at_its_line_with_the_stage_auto_gives():
    with pytest.raises(RecipeError) as refused:
        load_recipe_text(ONE_GPU, "r.yaml")
    [problem] = refused.value.problems
    assert (problem.key, problem.file, problem.line) == ("offload.zero_stage", "r.yaml", 5)
    assert "DeepSpeed's stage-0 bf16 optimizer took Adam steps 0.75x as long" in problem.message
    assert problem.hint.startswith("set offload.zero_stage=auto (ZeRO-1 for LoRA on one GPU")
    auto = ONE_GPU.replace("  zero_stage: 0", "  zero_stage: auto")
    assert load_recipe_text(auto, overrides=["model.lora.r=4"]).recipe.zero_stage == 1
    assert load_recipe_text(auto).recipe.zero_stage == 2  # a full fine-tune


def test_stage_zero_stays_for_fp32_weights_and_for_the_update_in_backward():
    assert load_recipe_text(ONE_GPU + "precision: {compute: fp32}\n").recipe.zero_stage == 0
    assert load_recipe_text(ONE_GPU + "precision: {compute: bf16, mode: autocast}\n").recipe.zero_stage == 0
    in_backward = ONE_GPU + (
        "precision: {master: bf16}\n"
        "optimizer: {step_in_backward: true, grad_clip: 0}\n"
        "batch: {global_batch: 4, micro_batch: 4}\n"
    )
    assert load_recipe_text(in_backward).recipe.zero_stage == 0
