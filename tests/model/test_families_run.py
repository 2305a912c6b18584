"""Each family trains through `memtrain run` (DeepSpeed on the CPU) from a saved model, and its merged
export gives the logits of base + adapter. Slow: one short real run per family."""
from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from memtrain.commands.run import run_command
from memtrain.model.export import export_run
from tests.model.test_merge import INPUT_IDS, _base_dir, _logits

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family", ["gemma2", "qwen3"])
def test_a_family_trains_with_lora_from_its_directory_and_exports_merged(family, write_recipe, tmp_path):
    base_dir = _base_dir(tmp_path, family)
    recipe = write_recipe(family, {
        "model": {"preset": None, "path": str(base_dir), "tokenizer": None,
                  "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "use_rslora": True}},
        "optimizer": {"lr": 3.0e-2},
        "train": {"steps": 4, "eval_every": 4, "save_every": 4},
    })
    assert run_command(recipe, []) == 0  # gemma2: eager attention picked for it, not transformers' sdpa refusal
    run_dir = tmp_path / "runs" / family
    merged = export_run(run_dir, merge=True)
    trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), run_dir / "final")
    reference = _logits(trained, INPUT_IDS)
    assert (reference - _logits(AutoModelForCausalLM.from_pretrained(base_dir), INPUT_IDS)).abs().max() > 1e-3
    assert (_logits(AutoModelForCausalLM.from_pretrained(merged), INPUT_IDS) - reference).abs().max() < 1e-5
