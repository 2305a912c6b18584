"""The second validation phase: what a recipe names outside itself, with the environment handed in as data."""
from __future__ import annotations

import pytest

from memtrain.checks.environment import Environment
from memtrain.checks.load import load_checked_text
from memtrain.errors import RecipeError

CHAT = """
model: {preset: micro, tokenizer: "builtin:shakespeare-chat"}
data:
  train:
    - {path: "builtin:chat", type: chat}
    - {path: %s, type: instruction}
  seq_len: 64
train: {steps: 4}
"""


def problems(text: str, env: Environment = Environment()) -> list[str]:
    with pytest.raises(RecipeError) as caught:
        load_checked_text(text, "chat.yaml", env=env)
    return [p.format() for p in caught.value.problems]


def test_each_dataset_path_of_a_list_is_checked_at_its_own_key_and_line(tmp_path):
    assert problems(CHAT % "missing.jsonl") == [
        "chat.yaml:6: data.train.1.path: dataset 'missing.jsonl' does not exist — give a .jsonl, .json, .parquet or "
        ".txt file or a datasets directory; relative paths start at the directory you run memtrain from"]
    [unknown] = problems(CHAT % '"builtin:wikipedia"')
    assert unknown.startswith("chat.yaml:6: data.train.1.path: there is no builtin dataset 'wikipedia'")
    present = tmp_path / "alpaca.jsonl"
    present.write_text('{"instruction": "Say hi.", "output": "hi"}\n')
    assert load_checked_text(CHAT % present, "chat.yaml").recipe.data.train[1].path == str(present)


def test_missing_packages_come_from_the_environment_given():
    qlora = """
model: {preset: micro, lora: {r: 4}, quantize: {type: nf4}}
data: {train: "builtin:shakespeare", seq_len: 64}
optimizer: {name: adamw_8bit}
train: {steps: 4}
"""
    assert load_checked_text(qlora, "q.yaml", env=Environment(bitsandbytes=True))
    found = problems(qlora, Environment(bitsandbytes=False))
    assert [p.split(": ")[1] for p in found] == ["model.quantize", "optimizer.name"]
    assert all("bitsandbytes" in p for p in found)
