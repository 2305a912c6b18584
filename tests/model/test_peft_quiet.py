"""PEFT's read of `is_gradient_checkpointing` makes transformers 5 warn at every LoRA build (PEFT before 0.22);
memtrain's builds do not show it (every LoRA run, plan, eval and merge printed it)."""

from __future__ import annotations

import warnings

from transformers import AutoModelForCausalLM

from memtrain.model.build import add_lora
from memtrain.model.config import model_config
from memtrain.model.peft_quiet import peft_quietly
from memtrain.recipe.schema import Lora, Model

MODEL = Model(preset="micro", lora=Lora(r=4, alpha=8, dropout=0.0))


def deprecation_warnings(build) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build(AutoModelForCausalLM.from_config(model_config(MODEL)))
    return [str(w.message) for w in caught if "is_gradient_checkpointing" in str(w.message)]


def test_the_read_peft_makes_warns_and_not_inside_peft_quietly():
    """Whichever PEFT is installed: transformers warns at the read, and not within peft_quietly (PEFT before 0.22 reads
    it bare at every build; 0.22 reads it quietly itself)."""
    assert deprecation_warnings(lambda lm: lm.is_gradient_checkpointing)

    def quiet_read(lm):
        with peft_quietly():
            return lm.is_gradient_checkpointing

    assert deprecation_warnings(quiet_read) == []


def test_a_lora_build_shows_no_gradient_checkpointing_deprecation():
    assert deprecation_warnings(lambda lm: add_lora(lm, MODEL)) == []
