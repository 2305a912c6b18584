"""Recipes that would be read wrong or read forever are refused with file:line: alias bombs, self-referential
aliases, true/false given for a number, values outside their sane range."""

from __future__ import annotations

import time

import pytest
import yaml

from memtrain.errors import RecipeError
from memtrain.recipe.load import MAX_ALIASES, load_recipe_text
from tests.conftest import TINY_RECIPE

TINY = yaml.safe_dump(TINY_RECIPE, sort_keys=False)


def refused(text: str, overrides: list[str] | None = None) -> str:
    with pytest.raises(RecipeError) as error:
        load_recipe_text(text, file="r.yaml", overrides=overrides)
    return str(error.value)


def test_an_alias_bomb_is_refused_at_once_with_its_line():
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]  # 9**9 values expanded
    start = time.perf_counter()
    message = refused(TINY + "\n".join(levels) + "\n")
    assert time.perf_counter() - start < 2
    assert f"more than {MAX_ALIASES} YAML aliases" in message and "r.yaml:" in message


def test_few_aliases_that_expand_to_a_huge_document_are_refused():
    levels = ["b0: &b0 [" + ", ".join(["x"] * 16) + "]"]
    levels += [f"b{i}: &b{i} [{', '.join([f'*b{i - 1}'] * 16)}]" for i in range(1, 4)]  # 48 aliases, 16**4 values
    assert "expand to more than" in refused(TINY + "\n".join(levels) + "\n")


def test_a_self_referential_alias_is_refused_without_a_traceback():
    message = refused("model: &m\n  preset: micro\n  again: *m\n")
    assert "r.yaml:3" in message and "contains it" in message


def test_a_few_aliases_still_work():
    text = TINY.replace("seq_len: 32", "seq_len: &n 32")
    assert load_recipe_text(text.replace("steps: 10", "steps: *n")).recipe.train.steps == 32


@pytest.mark.parametrize(
    "override", ["train.steps=true", "optimizer.lr=true", "batch.micro_batch=false", "model.lora.r=true"]
)
def test_true_or_false_for_a_number_is_refused(override):
    assert "must be a number, not true/false" in refused(TINY, [override])


@pytest.mark.parametrize(
    "override, says",
    [
        ("optimizer.weight_decay=1e6", "at most 1"),
        ("schedule.warmup_steps=50", "longer than the whole run"),
        ("train.max_bad_steps=0", "at least 1"),
        ("train.seed=18446744073709551616", "train.seed: must be at most 18446744073709551615"),  # past 64 bits
    ],
)
def test_numbers_outside_their_sane_range_are_refused(override, says):
    assert says in refused(TINY, [override])


def test_a_directory_given_as_a_data_file_is_reported_as_a_directory(tmp_path):
    from memtrain.checks.load import load_checked

    path = tmp_path / "r.yaml"
    path.write_text(TINY)
    with pytest.raises(RecipeError) as error:
        load_checked(path, [f"data.train={tmp_path}"])
    assert "is a directory, not a file" in str(error.value) and "data.train" in str(error.value)


@pytest.mark.parametrize("kind", ["a character device", "a named pipe (FIFO)"])
@pytest.mark.parametrize("form", ["a path", "a dataset"])
def test_a_device_or_a_fifo_given_as_data_is_said_as_what_it_is(tmp_path, kind, form):
    """/dev/zero or a FIFO read as data never ends; before, they were said to "not exist"."""
    import os

    from memtrain.checks.load import load_checked

    if kind == "a character device":
        data = "/dev/zero"
    else:
        data = str(tmp_path / "pipe.txt")
        os.mkfifo(data)
    path = tmp_path / "r.yaml"
    path.write_text(TINY)
    value = data if form == "a path" else f"[{{path: {data}, type: text}}]"
    with pytest.raises(RecipeError) as error:
        load_checked(path, [f"data.train={value}", f"data.validation={value}"])
    assert f"is {kind}, not a regular file" in str(error.value) and "data.train" in str(error.value), str(error.value)
    assert "does not exist" not in str(error.value)
