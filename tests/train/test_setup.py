"""build_data's refusal of a tokenizer larger than the model's vocabulary names the presets that would hold it."""

from __future__ import annotations

import json
import re

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


def test_too_few_packed_rows_for_a_global_batch_are_said_as_rows_not_samples(tmp_path):
    """24 short conversations packed into 256-token rows fill a few rows; the batch counts rows. The message once
    said "gives 3 samples" of data that held 24."""
    data = tmp_path / "chat.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": str(i)}]}
            )
            + "\n"
            for i in range(24)
        )
    )
    recipe = Recipe.model_validate(
        {
            "model": {"preset": "mini", "tokenizer": "builtin:shakespeare-chat"},
            "data": {
                "train": [{"path": str(data), "type": "chat"}],
                "template": "chatml",
                "seq_len": 256,
                "packing": True,
                "cache_dir": str(tmp_path / "cache"),
            },
            "batch": {"global_batch": 16, "micro_batch": 4},
            "train": {"steps": 4},
        }
    )
    with pytest.raises(DataError) as refused:
        build_data(recipe)
    [problem] = refused.value.problems
    assert problem.key == "batch.global_batch"
    assert re.fullmatch(
        r"the training data gives \d packed rows of 256 tokens, fewer than one global batch of 16 "
        r"\(23 samples packed into them: batch\.global_batch counts rows\)",
        problem.message,
    ), problem.message
    assert "data.packing: false" in problem.hint
