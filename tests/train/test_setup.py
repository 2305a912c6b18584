"""build_data's refusal of a tokenizer larger than the model's vocabulary names the presets that would hold it."""

from __future__ import annotations

import pytest

from memtrain.errors import DataError
from memtrain.recipe.schema import Recipe
from memtrain.train.setup import build_data


def test_a_tokenizer_larger_than_the_vocabulary_names_presets_that_hold_it(tmp_path):
    """The hint said 'a preset whose vocab_size is at least the tokenizer's' and named none."""
    recipe = Recipe.model_validate(
        {
            "model": {"preset": "tiny", "tokenizer": "builtin:shakespeare-chat"},
            "data": {
                "train": [{"path": "builtin:chat", "type": "chat"}],
                "template": "chatml",
                "seq_len": 64,
                "cache_dir": str(tmp_path / "cache"),
            },
            "batch": {"global_batch": 4, "micro_batch": 4},
            "train": {"steps": 4},
        }
    )
    with pytest.raises(DataError) as refused:
        build_data(recipe)
    [problem] = refused.value.problems
    assert problem.key == "model.tokenizer" and "but the model's vocabulary has 4096" in problem.message
    assert problem.hint.endswith("a preset whose vocab_size is at least the tokenizer's (model.preset=mini: 4,160)")
