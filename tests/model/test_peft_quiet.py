"""PEFT's read of `is_gradient_checkpointing` makes transformers 5 warn at every LoRA build; memtrain's builds do not
show it (every LoRA run, plan, eval and merge printed it)."""

from __future__ import annotations

import warnings

from peft import get_peft_model
from transformers import AutoModelForCausalLM

from memtrain.model.build import add_lora, lora_config
from memtrain.model.config import model_config
from memtrain.recipe.schema import Lora, Model

MODEL = Model(preset="micro", lora=Lora(r=4, alpha=8, dropout=0.0))


def deprecation_warnings(build) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build(AutoModelForCausalLM.from_config(model_config(MODEL)))
    return [str(w.message) for w in caught if "is_gradient_checkpointing" in str(w.message)]


def test_a_lora_build_shows_no_gradient_checkpointing_deprecation():
    assert deprecation_warnings(lambda lm: get_peft_model(lm, lora_config(MODEL.lora)))  # PEFT alone: it warns
    assert deprecation_warnings(lambda lm: add_lora(lm, MODEL)) == []
