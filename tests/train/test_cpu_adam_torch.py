"""offload.cpu_adam=torch: PyTorch's fused AdamW steps the optimizer offloaded to the CPU (nothing to build) and
trains as DeepSpeed's CPU Adam does, resumes exactly, and is refused where DeepSpeed accepts only its own."""

from __future__ import annotations

import pytest
import torch

from memtrain.commands.run import run_command
from memtrain.recipe.load import load_recipe_text
from memtrain.recipe.rules import check_rules
from memtrain.train.ops.deepspeed_ops import needs_cpu_adam
from memtrain.train.resolve import RunOptions
from tests.conftest import train_losses

OFFLOADED = {"optimizer": "cpu"}
ZERO3 = {"optimizer": "cpu", "params": "cpu"}


def _recipe_text(**offload) -> str:
    lines = [f"  {key}: {value}" for key, value in offload.items()]
    return "\n".join(
        ["model: {preset: micro}", "data: {train: 'builtin:shakespeare'}", "train: {steps: 10}", "offload:", *lines, ""]
    )


def _problems(text: str) -> str:
    """What the rules say about offload.cpu_adam (each problem at its file:line, for people)."""
    problems = [p for p in check_rules(load_recipe_text(text, "r.yaml", check=False)) if p.key == "offload.cpu_adam"]
    assert all(problem.line for problem in problems)
    return " ".join(problem.message + " " + problem.hint for problem in problems)


def test_torch_cpu_adam_needs_an_optimizer_offloaded_to_the_cpu_with_fp32_master_weights_and_no_partial_offload():
    assert _problems(_recipe_text(optimizer="cpu", cpu_adam="torch")) == ""
    assert "offload.optimizer is none" in _problems(_recipe_text(cpu_adam="torch"))
    assert "offload.optimizer is nvme" in _problems(_recipe_text(optimizer="nvme", cpu_adam="torch"))
    bf16 = _recipe_text(optimizer="cpu", cpu_adam="torch") + "precision: {compute: bf16, master: bf16}\n"
    assert "bf16 master weights" in _problems(bf16)
    partial = _recipe_text(optimizer="cpu", zero_stage=3, ratio=0.5, cpu_adam="torch")
    assert "partial offload" in _problems(partial)


def test_torch_cpu_adam_builds_no_op():
    text = _recipe_text(optimizer="cpu", cpu_adam="torch")
    assert not needs_cpu_adam(load_recipe_text(text, "r.yaml", check=False).recipe)
    assert needs_cpu_adam(load_recipe_text(_recipe_text(optimizer="cpu"), "r.yaml", check=False).recipe)


def _run(write_recipe, name: str, offload: dict, cpu_adam: str, steps: int = 6, **options) -> dict[int, float]:
    path = write_recipe(
        name,
        {"offload": {**offload, "cpu_adam": cpu_adam}, "train": {"steps": steps, "save_every": 3, "eval_every": 100}},
    )
    assert run_command(path, [], RunOptions(**options)) == 0
    return train_losses(path.parent / "runs" / name)


@pytest.mark.slow
@pytest.mark.parametrize("offload", [OFFLOADED, ZERO3], ids=["zero2", "zero3"])
def test_torch_fused_adamw_trains_like_deepspeeds_cpu_adam(write_recipe, offload):
    ours = _run(write_recipe, "torch", offload, "torch")
    theirs = _run(write_recipe, "deepspeed", offload, "deepspeed")
    assert sorted(ours) == list(range(1, 7))
    for step in ours:  # fp32 on the CPU: two implementations of the same update
        assert ours[step] == pytest.approx(theirs[step], rel=1e-4), step
    assert ours[6] < ours[1] - 0.5  # it trains


@pytest.mark.slow
def test_torch_fused_adamw_offload_resumes_exactly(write_recipe):
    straight = _run(write_recipe, "straight", OFFLOADED, "torch")
    _run(write_recipe, "halves", OFFLOADED, "torch", max_steps=3)
    halves = _run(write_recipe, "halves", OFFLOADED, "torch")
    assert sorted(halves) == list(range(1, 7))
    for step in straight:
        assert halves[step] == pytest.approx(straight[step], abs=1e-5), step


@pytest.mark.slow
def test_the_engine_steps_pytorchs_fused_adamw(process_group, write_recipe):
    from memtrain.ds_config.compiler import ds_config
    from memtrain.recipe.load import load_recipe
    from memtrain.train.setup import build_engine, build_policy_model

    recipe = load_recipe(write_recipe("engine", {"offload": {"optimizer": "cpu", "cpu_adam": "torch"}})).recipe
    config = ds_config(recipe, micro_batch=4)
    engine, _ = build_engine(recipe, build_policy_model(recipe, process_group, config), config, total_steps=10)
    inner = engine.optimizer.optimizer  # ZeRO's wrapper around the basic optimizer
    assert type(inner) is torch.optim.AdamW and inner.defaults["fused"] is True
