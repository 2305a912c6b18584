"""The second validation phase: what a recipe names outside itself, with the environment handed in as data."""

from __future__ import annotations

from pathlib import Path

import pytest

from memtrain.checks.environment import Environment
from memtrain.checks.load import load_checked, load_checked_text
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
        f".txt file or a datasets directory; a relative path starts at the directory memtrain runs in ({Path.cwd()})"
    ]
    [unknown] = problems(CHAT % '"builtin:wikipedia"')
    assert unknown.startswith("chat.yaml:6: data.train.1.path: there is no builtin dataset 'wikipedia'")
    present = tmp_path / "alpaca.jsonl"
    present.write_text('{"instruction": "Say hi.", "output": "hi"}\n')
    assert load_checked_text(CHAT % present, "chat.yaml").recipe.data.train[1].path == str(present)


def test_a_dataset_the_readers_cannot_read_is_refused_at_validate_as_run_refuses_it(tmp_path):
    """validate said "valid" for a .csv dataset that prepare and run then refused."""
    table = tmp_path / "pairs.csv"
    table.write_text("instruction,output\nSay hi.,hi\n")
    [csv] = problems(CHAT % table)
    assert csv.startswith("chat.yaml:6: data.train.1.path: cannot tell the format of pairs.csv") and ".jsonl" in csv
    text = tmp_path / "notes.txt"
    text.write_text("Say hi. hi\n")
    [plain] = problems(CHAT % text)
    assert (
        plain.startswith(f"chat.yaml:6: data.train.1.path: '{text}' is plain text, which holds no instruction records")
        and "type: text" in plain
    )
    assert load_checked_text(CHAT.replace("type: instruction", "type: text") % text, "chat.yaml")


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


def test_missing_paths_say_where_relative_paths_start_as_they_were_resolved(tmp_path, monkeypatch):
    recipe = tmp_path / "recipes" / "r.yaml"
    recipe.parent.mkdir()
    recipe.write_text(CHAT % "missing.jsonl")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with pytest.raises(RecipeError) as caught:
        load_checked(recipe, env=Environment())
    [in_file] = [p.format() for p in caught.value.problems]
    # written in the recipe: looked for beside the recipe, not in the directory memtrain runs in
    assert f"dataset '{recipe.parent / 'missing.jsonl'}' does not exist" in in_file
    assert (
        f"a relative path in a recipe starts at the directory of the recipe file that names it ({recipe.parent})"
        in in_file
    )
    assert "run memtrain from" not in in_file and str(elsewhere) not in in_file
    with pytest.raises(RecipeError) as caught:
        load_checked(recipe, ["data.train=gone.txt", "data.validation=gone.txt"], env=Environment())
    typed = [p.format() for p in caught.value.problems]
    assert typed and all(p.startswith("<command line>: data.") for p in typed)
    assert all(
        f"a relative path given on the command line starts at the directory memtrain runs in ({elsewhere})" in p
        for p in typed
    )


def test_a_missing_model_or_tokenizer_directory_says_where_relative_paths_start(tmp_path, monkeypatch):
    recipe = tmp_path / "recipes" / "r.yaml"
    recipe.parent.mkdir()
    recipe.write_text(
        "model: {path: ../models/base, tokenizer: tok}\ndata: {train: 'builtin:shakespeare', "
        "seq_len: 64}\ntrain: {steps: 4}\n"
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError) as caught:
        load_checked(recipe, env=Environment())
    model, tokenizer = [p.format() for p in caught.value.problems]
    assert f"model directory '{tmp_path / 'models' / 'base'}' does not exist" in model
    assert f"tokenizer directory '{recipe.parent / 'tok'}' does not exist" in tokenizer
    assert all(
        f"starts at the directory of the recipe file that names it ({recipe.parent})" in p for p in (model, tokenizer)
    )
    with pytest.raises(RecipeError) as caught:
        load_checked(recipe, ["model.path=base"], env=Environment())
    [typed] = [p.format() for p in caught.value.problems if "model.path" in p.format()]
    assert f"starts at the directory memtrain runs in ({tmp_path})" in typed


def test_a_missing_text_file_in_a_recipe_is_looked_for_beside_the_recipe(tmp_path, monkeypatch):
    recipe = tmp_path / "recipes" / "r.yaml"
    recipe.parent.mkdir()
    recipe.write_text("model: {preset: micro}\ndata: {train: no/train.txt, seq_len: 64}\ntrain: {steps: 4}\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError) as caught:
        load_checked(recipe, env=Environment())
    [problem] = [p.format() for p in caught.value.problems]
    assert f"data file '{recipe.parent / 'no/train.txt'}' does not exist" in problem
    assert f"starts at the directory of the recipe file that names it ({recipe.parent})" in problem


def test_validate_refuses_what_plan_and_run_would_before_reading_any_data(tmp_path):
    """A typo in a builtin tokenizer or a template name, and a model that is not a causal LM, were 'valid' until
    plan or run refused them: each is now a problem at its key and line."""
    text = CHAT % '"builtin:chat"'
    [tokenizer] = problems(text.replace("builtin:shakespeare-chat", "builtin:shakespeare-chatt"))
    assert tokenizer.startswith("chat.yaml:2: model.tokenizer: no builtin tokenizer 'builtin:shakespeare-chatt'")
    assert "builtin:shakespeare-chat" in tokenizer.split("—")[1]
    [template] = problems(text.replace("seq_len: 64", "seq_len: 64\n  template: chatmll"))
    assert template.startswith("chat.yaml:8: data.template: there is no chat template 'chatmll' — use one of ")
    from transformers import BertConfig

    BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64).save_pretrained(
        tmp_path
    )
    [encoder] = problems(text.replace("preset: micro", f"path: {tmp_path}"))
    assert encoder.startswith("chat.yaml:2: model.path: 'bert' is an encoder-only (masked language) model")


def test_chat_data_whose_tokenizer_has_no_chat_template_is_refused_at_validate(tmp_path):
    """`validate` said "valid", and the first command that tokenised refused it. The tokenizer's files are
    read, not loaded; a tokenizer directory without a chat_template (here a copy of the plain bundled one) too."""
    chat = CHAT.replace("    - {path: %s, type: instruction}\n", "")
    [said] = problems(chat.replace("builtin:shakespeare-chat", "builtin:shakespeare"))
    assert (
        said.startswith("chat.yaml:3: data.template: the tokenizer (model.tokenizer: ")
        and "has no chat_template" in said
    )
    assert "set data.template to one of" in said and "chatml" in said
    assert load_checked_text(chat, "chat.yaml")  # the chat tokenizer has one
    assert load_checked_text(
        chat.replace("builtin:shakespeare-chat", "builtin:shakespeare").replace(
            "  seq_len: 64", "  seq_len: 64\n  template: chatml\n  add_special_tokens: true"
        ),
        "chat.yaml",
    )


@pytest.mark.parametrize("name", ["pairs.json", "pairs.csv", "pairs.parquet", "pairs.json.gz"])
def test_a_file_of_records_given_as_a_data_path_is_refused_not_trained_on_as_text(tmp_path, name):
    """`data.train: my_alpaca.json` trained on the JSON's brackets and keys; validate passed it."""
    from memtrain.data.rows.dataset import build_datasets
    from memtrain.data.tokens.tokenizer import load_tokenizer
    from memtrain.errors import DataError
    from memtrain.recipe.schema import Data, Model

    records = tmp_path / name
    records.write_bytes(b'[{"instruction": "Say hi.", "output": "hi"}]')
    text = f"model: {{preset: micro}}\ndata:\n  train: {records}\n  seq_len: 64\ntrain: {{steps: 4}}\n"
    [said] = problems(text)
    assert said.startswith(f"chat.yaml:3: data.train: '{records}' is a .{name.split('.')[1]} file of records")
    assert "type: instruction" in said and "data.format: text" in said
    with pytest.raises(DataError, match="file of records"):
        build_datasets(Data(train=str(records), seq_len=64), load_tokenizer(Model(preset="micro")), seed=0)
    assert load_checked_text(text.replace("  seq_len: 64", "  seq_len: 64\n  format: text"), "chat.yaml")


def test_a_recipe_named_relatively_says_the_absolute_directory_paths_start_at(tmp_path, monkeypatch):
    """'starts at the directory of the recipe file that names it (.)'."""
    (tmp_path / "r.yaml").write_text(CHAT % "missing.jsonl")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError) as caught:
        load_checked(Path("r.yaml"), env=Environment())
    [said] = [p.format() for p in caught.value.problems]
    assert f"the recipe file that names it ({tmp_path.resolve()})" in said
