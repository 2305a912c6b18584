"""The model-family presets build on the meta device with the parameter counts their model cards publish."""

from __future__ import annotations

import pytest

from memtrain.model.config import meta_model, model_architecture
from memtrain.recipe.schema import Model

# Parameter counts published for the models the presets copy (model cards / safetensors metadata).
PUBLISHED_PARAMS = {
    "qwen2.5-7b": 7.61e9,  # Qwen/Qwen2.5-7B: "Number of Parameters: 7.61B"
    "qwen3-8b": 8.2e9,  # Qwen/Qwen3-8B: "Number of Parameters: 8.2B"
    "mistral-7b-v0.3": 7.25e9,  # mistralai/Mistral-7B-v0.3: 7.25B
    "gemma2-9b": 9.24e9,  # google/gemma-2-9b: 9.24B
    "phi3-mini": 3.82e9,  # microsoft/Phi-3-mini-4k-instruct: 3.8B (3.82B in its safetensors)
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED_PARAMS))
def test_preset_parameter_count_matches_the_published_figure(preset):
    model = meta_model(Model(preset=preset))
    # tied embeddings are one tensor: parameters() yields it once
    count = sum(p.numel() for p in model.parameters())
    assert count == pytest.approx(PUBLISHED_PARAMS[preset], rel=0.01)


def test_family_specific_fields_survive_into_the_config():
    gemma = model_architecture(Model(preset="gemma2-9b"))
    assert (gemma.logit_softcap, gemma.tied_embeddings, gemma.vocab_size) == (30.0, True, 256000)
    assert gemma.sliding_window_tokens == 4096 and gemma.num_layers == 42
    qwen = model_architecture(Model(preset="qwen2.5-7b"))
    assert (qwen.logit_softcap, qwen.tied_embeddings, qwen.sliding_window_tokens) == (None, False, None)
    assert model_architecture(Model(preset="phi3-mini")).sliding_window_tokens == 2047
    assert model_architecture(Model(preset="qwen3-8b")).num_layers == 36
