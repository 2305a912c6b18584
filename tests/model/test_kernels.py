"""model.kernels: which runs use Liger's kernels, and that the CPU path (and its plan) does not change."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from memtrain.cli import app
from memtrain.errors import UserError
from memtrain.model.kernels import KernelSupport, resolve_kernels, uses_fused_loss
from memtrain.plan.logits import estimate_fused_logits, estimate_logits, fused_chunk_tokens
from memtrain.plan.planner import plan_recipe
from memtrain.recipe.load import load_recipe
from memtrain.recipe.schema import Lora, Model, Precision
from memtrain.train.resolve import resolve_run, with_kernels

ROOT = Path(__file__).resolve().parents[2]
GPU_MACHINE = KernelSupport(liger=True, cuda=True)


def test_auto_resolves_to_none_on_this_cpu_machine():
    support = KernelSupport.current()
    assert not support.cuda  # the CPU CI this test is for
    assert resolve_kernels(Model(preset="tiny"), support) == "none"


@pytest.mark.parametrize(
    "support, expected",
    [
        (KernelSupport(liger=True, cuda=True), "liger"),
        (KernelSupport(liger=True, cuda=False), "none"),
        (KernelSupport(liger=False, cuda=True), "none"),
    ],
)
def test_auto_needs_liger_and_cuda(support, expected):
    assert resolve_kernels(Model(preset="llama2-7b"), support) == expected
    assert resolve_kernels(Model(preset="llama2-7b", kernels="none"), GPU_MACHINE) == "none"


def test_liger_where_it_cannot_run_names_every_reason():
    with pytest.raises(UserError) as caught:
        resolve_kernels(Model(preset="tiny", kernels="liger"), KernelSupport(liger=False, cuda=False))
    text = str(caught.value)
    assert "not installed" in text and "memtrain[liger]" in text and "CUDA" in text
    assert all(p.key == "model.kernels" for p in caught.value.problems)
    assert resolve_kernels(Model(preset="gemma2-9b", kernels="liger"), GPU_MACHINE) == "liger"


def test_liger_on_cpu_is_exit_2_with_the_recipe_line(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text((ROOT / "recipes/quickstart.yaml").read_text() + "\n")
    result = CliRunner().invoke(
        app,
        [
            "run",
            str(recipe),
            "model.kernels=liger",
            "train.steps=1",
            "schedule.warmup_steps=0",
            f"train.output_dir={tmp_path / 'run'}",
        ],
    )
    assert result.exit_code == 2, result.output
    assert "CUDA" in result.output and "model.kernels" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "run").exists()


def test_fused_loss_only_where_the_head_weight_is_plain_and_whole():
    liger = Model(preset="llama2-7b", kernels="liger")
    cast = Precision()
    assert uses_fused_loss(liger, cast, zero_stage=2)
    assert not uses_fused_loss(Model(preset="llama2-7b", kernels="auto"), cast, 2)  # unresolved counts as no
    assert not uses_fused_loss(liger, cast, zero_stage=3)
    assert not uses_fused_loss(liger, Precision(mode="autocast"), 2)
    assert not uses_fused_loss(liger, Precision(fp32_modules=["lm_head"]), 2)
    assert uses_fused_loss(liger, Precision(fp32_modules=["*norm*"]), 2)
    lora = liger.model_copy(update={"lora": Lora(modules_to_save=["lm_head"])})
    assert not uses_fused_loss(lora, cast, 2)
    assert uses_fused_loss(liger.model_copy(update={"lora": Lora()}), cast, 2)


def test_fused_loss_pricing_keeps_no_vocabulary_sized_logits():
    # liger 0.8.5: 4096 tokens, hidden 4096, vocabulary 32000 -> 8 chunks of 512 rows
    assert fused_chunk_tokens(4096, 4096, 32000) == 512
    assert fused_chunk_tokens(100, 4096, 32000) == 16
    fused = estimate_fused_logits(4096, 32000, "bf16", 4, 1024, head_trainable=False)
    chunked = estimate_logits(4096, 32000, "bf16", 4, 1024, True, 1024, True)
    assert fused.tokens == 512 and fused.backward_bytes == 4096 * 4096 * 2
    assert fused.peak_bytes < chunked.peak_bytes
    full = estimate_fused_logits(4096, 32000, "bf16", 4, 1024, head_trainable=True)
    assert full.saved_bytes - fused.saved_bytes == 32000 * 4096 * 2  # the head's gradient, from forward on


def test_the_cpu_run_plans_exactly_as_before():
    recipe = load_recipe(ROOT / "recipes/quickstart.yaml").recipe
    resolved = resolve_run(recipe, "quickstart", Path("/tmp/unused"), 10_000, exact_pinned=True)
    assert resolved.recipe.model.kernels == "none"
    assert plan_recipe(resolved.recipe).to_json() == plan_recipe(recipe).to_json()
    assert plan_recipe(with_kernels(recipe, "liger")).to_json() != plan_recipe(recipe).to_json()


def test_the_liger_plan_of_the_7b_lora_recipe_prices_the_fused_loss():
    recipe = load_recipe(ROOT / "recipes/llama2-7b-lora-24gb.yaml").recipe
    eager, liger = plan_recipe(with_kernels(recipe, "none")), plan_recipe(with_kernels(recipe, "liger"))
    assert liger.logits_loss < eager.logits_loss
    assert liger.activations < eager.activations  # Liger's layers keep less (next test)
    assert liger.peak_reserved_bytes < eager.peak_reserved_bytes


def test_liger_layers_keep_what_their_autograd_functions_save():
    """Liger's kernels cannot run in the planner's fake-tensor trace; the eager trace is edited by what they keep:
    per RMSNorm its input and an fp32 rstd per row instead of an fp32 copy of the input, a bf16 normalised copy
    and the rstd; no SiLU output (the fused SiLU-and-multiply keeps gate and up, which eager keeps too)."""
    from memtrain.plan.activations import trace_layer
    from memtrain.recipe.schema import Model

    tokens, hidden, intermediate = 1024, 4096, 11008  # the llama2-7b preset, one sequence
    eager = trace_layer(Model(preset="llama2-7b", kernels="none"), "bf16", 1, tokens)
    liger = trace_layer(Model(preset="llama2-7b", kernels="liger"), "bf16", 1, tokens)
    per_norm = hidden * 4  # (fp32 copy 4 + normalised copy 2) bytes per element, less the input Liger keeps (2)
    assert eager.full_bytes - liger.full_bytes == (2 * per_norm + 2 * intermediate) * tokens

    def input_sizes(trace):  # what recomputing each block keeps
        return {block: nbytes for block, (_, nbytes) in trace.inputs.items()}

    assert liger.layer_input_bytes == eager.layer_input_bytes and input_sizes(liger) == input_sizes(eager)


def test_compiled_layers_take_liger_s_loss_only():
    """Compiled layers are built without Liger's layer kernels (dynamo splits a layer around their Triton launches:
    8,021 against 11,583 tokens/s without them, docs/BENCHMARKS.md), so auto keeps only the fused loss."""
    llama = Model(preset="llama2-7b")
    assert resolve_kernels(llama, GPU_MACHINE, compiled=True) == "liger_loss"
    assert resolve_kernels(llama, KernelSupport(liger=False, cuda=True), compiled=True) == "none"
    assert (
        resolve_kernels(Model(preset="llama2-7b", kernels="liger"), GPU_MACHINE, compiled=True) == "liger"
    )  # as asked
    assert resolve_kernels(Model(preset="llama2-7b", kernels="liger_loss"), GPU_MACHINE) == "liger_loss"
    with pytest.raises(UserError, match="liger_loss needs a CUDA GPU"):
        resolve_kernels(Model(preset="llama2-7b", kernels="liger_loss"), KernelSupport(liger=True, cuda=False))
    assert uses_fused_loss(Model(preset="llama2-7b", kernels="liger_loss"), Precision(), zero_stage=2)


def test_the_liger_loss_plan_prices_the_fused_loss_and_eager_layers():
    recipe = load_recipe(ROOT / "recipes/llama2-7b-lora-24gb.yaml").recipe
    eager, loss_only, liger = (
        plan_recipe(with_kernels(recipe, kernels)) for kernels in ("none", "liger_loss", "liger")
    )
    assert loss_only.logits_loss == liger.logits_loss < eager.logits_loss
    assert loss_only.activations == eager.activations > liger.activations


def test_the_7b_lora_recipe_resolves_to_compiled_layers_and_liger_s_loss_on_a_gpu_machine():
    recipe = load_recipe(ROOT / "recipes/llama2-7b-lora-24gb.yaml").recipe
    assert recipe.train.compile == "auto" and recipe.model.kernels == "auto"
    resolved = resolve_run(recipe, "lora", Path("/tmp/unused"), 10_000, exact_pinned=True, kernels=GPU_MACHINE)
    assert resolved.recipe.train.compile is True and resolved.recipe.model.kernels == "liger_loss"
    on_cpu = resolve_run(
        recipe, "lora", Path("/tmp/unused"), 10_000, exact_pinned=True, kernels=KernelSupport(liger=True, cuda=False)
    )
    # its memory budget is the compiler's, so the layers compile on the CPU too; Liger's loss needs CUDA
    assert on_cpu.recipe.train.compile is True and on_cpu.recipe.model.kernels == "none"
    # run.json holds the resolved values, which a worker reads back
    from memtrain.train.resolve import ResolvedRun

    assert ResolvedRun.from_json(resolved.to_json()).recipe == resolved.recipe
