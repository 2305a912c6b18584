"""train.eval_generate: scored against answers, so refused for text-only held-out data and under ZeRO-3."""

from __future__ import annotations

import pytest

from memtrain.errors import RecipeError
from memtrain.recipe.load import load_recipe_text

CHAT = """\
model: {preset: mini, tokenizer: "builtin:shakespeare-chat"}
data:
  train: [{path: "builtin:chat", type: chat}]
  template: chatml
train: {steps: 10, eval_generate: 20}
"""


def problems(text: str, *overrides: str) -> list:
    with pytest.raises(RecipeError) as caught:
        load_recipe_text(text, "r.yaml", list(overrides))
    return [p for p in caught.value.problems if p.key == "train.eval_generate"]


def test_chat_data_may_be_scored_by_generation():
    assert load_recipe_text(CHAT, "r.yaml").recipe.train.eval_generate == 20


def test_text_only_held_out_data_is_refused_at_its_line():
    text = CHAT.replace('[{path: "builtin:chat", type: chat}]', '"builtin:shakespeare"')
    [problem] = problems(text)
    assert "text only" in problem.message and problem.line == 5 and "eval_generate=0" in problem.hint
    # chat training data, but text held out: nothing to score either
    [problem] = problems(
        CHAT.replace(
            "  template: chatml",
            '  template: chatml\n  validation: [{path: "builtin:shakespeare/validation", type: text}]',
        )
    )
    assert "text only" in problem.message


def test_zero3_is_refused_with_the_command_that_scores_afterwards():
    [problem] = problems(CHAT, "offload.zero_stage=3")
    assert "ZeRO-3" in problem.message and "memtrain eval" in problem.hint
