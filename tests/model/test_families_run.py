"""Each family trains through `memtrain run` (DeepSpeed on the CPU) from a saved model, and its merged
export gives the logits of base + adapter. Slow: one short real run per family."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from memtrain.commands.run import run_command
from memtrain.model.final_dir import export_run
from tests.model.test_merge import INPUT_IDS, _base_dir, _logits

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family", ["gemma2", "qwen3"])
def test_a_family_trains_with_lora_from_its_directory_and_exports_merged(family, write_recipe, tmp_path):
    base_dir = _base_dir(tmp_path, family)
    recipe = write_recipe(
        family,
        {
            "model": {
                "preset": None,
                "path": str(base_dir),
                "tokenizer": None,
                "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "use_rslora": True},
            },
            "optimizer": {"lr": 3.0e-2},
            "train": {"steps": 4, "eval_every": 4, "save_every": 4},
        },
    )
    assert run_command(recipe, []) == 0  # gemma2: eager attention picked for it, not transformers' sdpa refusal
    run_dir = tmp_path / "runs" / family
    merged = export_run(run_dir, merge=True)
    trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), run_dir / "final")
    reference = _logits(trained, INPUT_IDS)
    assert (reference - _logits(AutoModelForCausalLM.from_pretrained(base_dir), INPUT_IDS)).abs().max() > 1e-3
    assert (_logits(AutoModelForCausalLM.from_pretrained(merged), INPUT_IDS) - reference).abs().max() < 1e-5


RESUMABLE = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3"]


@pytest.mark.parametrize("family", RESUMABLE)
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_each_family_trains_resumes_exactly_and_exports(family, mode, write_recipe, tmp_path):
    """Issue 22's CPU proof: every family of the presets, as a tiny model of its model_type saved to a directory,
    trains through DeepSpeed with LoRA and as a full fine-tune, a run stopped halfway and resumed gives the
    straight run's losses, and its export loads (merged, for LoRA)."""
    from memtrain.train.resolve import RunOptions
    from tests.conftest import train_losses

    base_dir = _base_dir(tmp_path, family)
    model = {"preset": None, "path": str(base_dir), "tokenizer": None}
    if mode == "lora":  # the default targets, all-linear: Phi-3's fused qkv_proj / gate_up_proj as well
        model["lora"] = {"r": 4, "alpha": 8, "dropout": 0.0}
    extra = {"model": model, "optimizer": {"lr": 1.0e-2}, "train": {"steps": 4, "eval_every": 100, "save_every": 2}}
    straight, halves = write_recipe("straight", extra), write_recipe("halves", extra)
    assert run_command(straight, []) == 0
    assert run_command(halves, [], RunOptions(max_steps=2)) == 0
    assert run_command(halves, []) == 0
    a, b = train_losses(tmp_path / "runs" / "straight"), train_losses(tmp_path / "runs" / "halves")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert b[step] == pytest.approx(a[step], abs=1e-5), (family, mode, step)
    exported = export_run(tmp_path / "runs" / "halves", merge=mode == "lora")
    logits = _logits(AutoModelForCausalLM.from_pretrained(exported), INPUT_IDS)
    assert torch.isfinite(logits).all()
    assert (logits - _logits(AutoModelForCausalLM.from_pretrained(base_dir), INPUT_IDS)).abs().max() > 1e-4
