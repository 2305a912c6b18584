"""Every hand-made bad recipe in tests/recipe/bad_recipes gives exit code 2 and exactly the problems it declares.

Each file states its expected problems in leading comments:
    # expect: 7: batch.micro_batch                  this file, line 7, key batch.micro_batch
    # expect: -: data                               this file, no line (the key is absent), key data
    # expect: parts/base.yaml:6: optimizer.lr       another file (relative to this one), line 6
    # expect: <command line>: batch.micro_batch     an override
    # expect: 4: -                                  line 4, no key (YAML syntax)
    # args: batch.micro_batch=0                     overrides passed after the recipe
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memtrain.cli import app
from memtrain.errors import RecipeError
from memtrain.recipe.load import load_recipe_text
from memtrain.recipe.messages import FAMILIAR_KEYS
from memtrain.recipe.schema import Recipe

BAD_DIR = Path(__file__).parent / "bad_recipes"
BAD_RECIPES = sorted(BAD_DIR.glob("*.yaml"))
PROBLEM_MARK = "✗ "


def expectations(path: Path) -> tuple[list[str], list[str]]:
    """(expected problem-line prefixes, override args) declared in the recipe's comments."""
    prefixes, args = [], []
    for line in path.read_text().splitlines():
        if line.startswith("# args: "):
            args = line[len("# args: ") :].split()
        if not line.startswith("# expect: "):
            continue
        location, _, key = line[len("# expect: ") :].partition(": ")
        if location == "<command line>":
            where = location
        elif location == "-":
            where = str(path)
        elif ":" in location:
            other, line_number = location.rsplit(":", 1)
            where = f"{path.parent / other}:{line_number}"
        else:
            where = f"{path}:{location}"
        prefixes.append(f"{where}: " if key == "-" else f"{where}: {key}: ")
    return prefixes, args


def problem_lines(output: str) -> list[str]:
    return [line.split(PROBLEM_MARK, 1)[1] for line in output.splitlines() if PROBLEM_MARK in line]


def test_there_are_enough_bad_recipes():
    assert len(BAD_RECIPES) >= 20
    assert all(expectations(path)[0] for path in BAD_RECIPES), "every bad recipe declares its problems"


@pytest.mark.parametrize("path", BAD_RECIPES, ids=lambda p: p.stem)
def test_bad_recipe_reports_each_declared_problem(path: Path):
    expected, args = expectations(path)
    result = CliRunner().invoke(app, ["validate", str(path), *args])
    output = result.output
    assert "Traceback" not in output and result.exception is None or isinstance(result.exception, SystemExit)
    assert result.exit_code == 2, output
    found = problem_lines(output)
    assert len(found) == len(expected), f"expected {len(expected)} problems, got:\n{output}"
    unmatched = list(found)
    for prefix in expected:
        match = next((line for line in unmatched if line.startswith(prefix)), None)
        assert match is not None, f"no problem starting with {prefix!r} in:\n{output}"
        unmatched.remove(match)
        message = match[len(prefix) :]
        # what is wrong, then " — " and what to do about it
        what, _, hint = message.partition(" — ")
        assert what.strip() and hint.strip(), f"problem without a message or a hint: {match!r}"
        assert "Input should" not in message, f"raw pydantic message: {match!r}"


def test_unknown_keys_suggest_the_key_meant():
    result = CliRunner().invoke(app, ["validate", str(BAD_DIR / "05_unknown_keys_every_level.yaml")])
    for typo, meant in [
        ("alhpa", "alpha"),
        ("seqlen", "seq_len"),
        ("queue_dept", "queue_depth"),
        ("grow_belw", "grow_below"),
    ]:
        line = next(line for line in problem_lines(result.output) if f".{typo}:" in line)
        assert f"did you mean '{meant}'?" in line


def test_another_tools_key_names_memtrains_own():
    """optimizer.learning_rate listed the section's keys; seq_length already suggested seq_len."""
    text = "model: {preset: tiny}\ndata: {train: 'builtin:shakespeare'}\ntrain: {steps: 4}\n"
    with pytest.raises(RecipeError) as refused:
        load_recipe_text(text, overrides=["optimizer.learning_rate=1e-4", "num_train_epochs=2"])
    hints = {p.key: p.hint for p in refused.value.problems}
    assert hints == {
        "optimizer.learning_rate": "memtrain's key for it is optimizer.lr",
        "num_train_epochs": "memtrain's key for it is train.epochs",
    }
    for key in {target.split(" ")[0] for target in FAMILIAR_KEYS.values()}:  # each names a key the schema has
        section = Recipe
        for part in key.split("."):
            field = section.model_fields[part]
            section = next(
                (
                    a
                    for a in (field.annotation, *getattr(field.annotation, "__args__", ()))
                    if hasattr(a, "model_fields")
                ),
                None,
            )


def test_out_of_range_messages_are_short_and_show_the_value():
    result = CliRunner().invoke(app, ["validate", str(BAD_DIR / "07_out_of_range.yaml")])
    lines = "\n".join(problem_lines(result.output))
    assert "batch.global_batch: must be at least 1, got 0" in lines
    assert "optimizer.lr: must be less than 1, got 2.0" in lines
    assert "data.seq_len: must be at least 8, got 4" in lines
    assert "greater than or equal" not in lines


@pytest.mark.slow  # 5-20 s on two cores: plain pytest stays under 2 minutes; scripts/test.sh (CI) runs it
def test_a_real_process_exits_2_without_a_traceback():
    env = {**os.environ, "COLUMNS": "200"}
    path = BAD_DIR / "23_fields_and_contradictions_together.yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "memtrain", "validate", str(path)], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stdout + proc.stderr
    assert len(problem_lines(proc.stderr)) == 4


def test_dataset_entries_are_named_by_their_own_keys_and_described_by_dataset_spec():
    result = CliRunner().invoke(app, ["validate", str(BAD_DIR / "33_dataset_entries.yaml")])
    lines = {line.split(": ", 2)[1]: line for line in problem_lines(result.output)}
    assert "unknown key — did you mean 'weight'?" in lines["data.train.0.weigth"]
    assert "got 'chatt' — text: documents trained on whole" in lines["data.train.0.type"]
    assert "got 'robot' — chat: extra role names" in lines["data.train.0.roles.bot"]
    assert "required key is missing — add 'type' to data.train.1: text: documents" in lines["data.train.1.type"]
    assert "got '' — text: the field holding the document" in lines["data.validation.field"]
    assert "Training data" not in result.output  # data.train's own description is not the hint for its items


def test_a_dataset_key_of_another_type_names_the_types_it_applies_to_and_this_ones():
    result = CliRunner().invoke(app, ["validate", str(BAD_DIR / "35_dataset_keys_of_another_type.yaml")])
    lines = {line.split(": ", 2)[1]: line.split(": ", 2)[2] for line in problem_lines(result.output)}
    assert lines["data.train.0.prompt_field"].startswith(
        "is read only for completion, preference and kto datasets, and this dataset's type is chat, so it would do "
        "nothing — remove"
    )
    assert lines["data.validation.0.system_field"].startswith(
        "is read only for instruction and chat datasets, and this dataset's type is completion"
    )
    assert "data.train.0.system_field" not in lines and "data.train.1.field" not in lines


def test_a_recipe_dumped_whole_with_datasets_of_every_type_reads_back():
    """run.json and every checkpoint keep the recipe with each default spelled out (prompt_field: prompt on a chat
    dataset too); the check above must not refuse what memtrain itself wrote (it did, until the default was let
    through: `memtrain eval` and resuming such a run failed)."""
    from memtrain.recipe.schema import Recipe

    datasets = [{"path": "builtin:chat", "type": kind} for kind in ("text", "completion", "instruction", "chat")]
    recipe = Recipe.model_validate({"model": {"preset": "tiny"}, "data": {"train": datasets}, "train": {"steps": 1}})
    assert Recipe.model_validate(recipe.model_dump(mode="json")) == recipe


def test_stepping_in_backward_takes_the_default_micro_batch_as_the_whole_batch(tmp_path):
    """With batch.micro_batch 'auto' (the default, never written) step_in_backward was refused for a
    micro-batch other than the global batch; auto is the global batch there, the only size it can run."""
    from memtrain.plan.planner import plan_recipe
    from memtrain.recipe.load import load_recipe

    recipes = Path(__file__).resolve().parents[2] / "recipes"
    shipped = recipes / "llama2-7b-full-32gb-host.yaml"
    recipe = tmp_path / "in-backward.yaml"
    recipe.write_text(shipped.read_text().replace("  micro_batch: 16\n", "") + f"# from {shipped}\n")
    recipe.with_name("llama2-7b-full-offload-2x24gb.yaml").write_text(
        (recipes / "llama2-7b-full-offload-2x24gb.yaml").read_text().replace("  micro_batch: 2\n", "")
    )
    result = CliRunner().invoke(app, ["validate", str(recipe)])
    assert result.exit_code == 0, result.output
    loaded = load_recipe(recipe)
    assert loaded.recipe.batch.micro_batch == "auto" and plan_recipe(loaded.recipe).micro_batch == 16
    refused = CliRunner().invoke(app, ["validate", str(recipe), "batch.micro_batch=8"])
    assert refused.exit_code == 2 and "set batch.micro_batch=16 (= batch.global_batch)" in refused.output
