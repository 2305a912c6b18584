"""Loading recipes: `extends:`, command-line overrides, where problems point, problems reported together,
the shipped recipes, and the JSON Schema that `memtrain schema` prints."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from memtrain.checks.load import load_checked
from memtrain.cli import app
from memtrain.errors import RecipeError
from memtrain.recipe.load import load_recipe, load_recipe_text
from memtrain.recipe.sources import COMMAND_LINE

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))

BASE = """\
model:
  preset: tiny
data:
  train: builtin:shakespeare
  seq_len: 64
optimizer:
  lr: 1.0e-4
  weight_decay: 0.1
train:
  steps: 10
"""


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def problems_of(call) -> list:
    with pytest.raises(RecipeError) as caught:
        call()
    return caught.value.problems


def test_child_wins_and_each_key_remembers_its_file_and_line(tmp_path):
    base = write(tmp_path / "base.yaml", BASE)
    child = write(
        tmp_path / "child.yaml",
        """\
        extends: base.yaml
        optimizer:
          lr: 3.0e-4
        """,
    )
    loaded = load_recipe(child)
    assert loaded.recipe.optimizer.lr == 3.0e-4  # the child's value
    assert loaded.recipe.optimizer.weight_decay == 0.1  # the base's sibling key survives the merge
    assert loaded.recipe.train.steps == 10
    assert loaded.sources.where(("optimizer", "lr")) == (str(child), 3)
    assert loaded.sources.where(("optimizer", "weight_decay")) == (str(base), 8)
    assert loaded.name == "child"


def test_extends_chains_of_three_resolve_relative_to_each_file(tmp_path):
    (tmp_path / "a").mkdir()
    write(tmp_path / "a" / "base.yaml", BASE)
    write(tmp_path / "middle.yaml", "extends: a/base.yaml\ntrain:\n  steps: 20\n")
    (tmp_path / "b").mkdir()
    top = write(tmp_path / "b" / "top.yaml", "extends: ../middle.yaml\nbatch:\n  global_batch: 8\n")
    recipe = load_recipe(top).recipe
    assert (recipe.train.steps, recipe.batch.global_batch, recipe.optimizer.lr) == (20, 8, 1.0e-4)


def test_extends_naming_a_directory_or_a_fifo_says_what_it_is_not_that_it_is_missing(tmp_path):
    import os

    (tmp_path / "base.yaml").mkdir()
    os.mkfifo(tmp_path / "pipe.yaml")  # read, it would wait for a writer forever
    for name, kind in (("base.yaml", "a directory"), ("pipe.yaml", "a named pipe (FIFO)")):
        child = write(tmp_path / "child.yaml", f"extends: {name}\noptimizer:\n  lr: 3.0e-4\n")
        [problem] = [p for p in problems_of(lambda child=child: load_recipe(child)) if p.key == "extends"]
        assert f"is {kind}, not a recipe file" in problem.message and problem.key == "extends", problem
        assert (problem.file, problem.line) == (str(child), 1)
    [problem] = problems_of(lambda: load_recipe(tmp_path / "pipe.yaml"))
    assert "is a named pipe (FIFO), not a recipe file" in problem.message


def test_a_child_replacing_a_list_drops_the_base_item_lines(tmp_path):
    write(tmp_path / "base.yaml", BASE + "precision:\n  fp32_modules:\n    - lm_head\n    - '*norm*'\n")
    child = write(tmp_path / "child.yaml", "extends: base.yaml\nprecision:\n  fp32_modules: 3\n")
    [problem] = problems_of(lambda: load_recipe(child))
    assert (problem.file, problem.line, problem.key) == (str(child), 3, "precision.fp32_modules")


def test_missing_extended_file_points_at_the_extends_line(tmp_path):
    child = write(tmp_path / "child.yaml", "model:\n  preset: tiny\nextends: nowhere.yaml\n")
    problems = problems_of(lambda: load_recipe(child))
    assert any(p.key == "extends" and p.line == 3 and "nowhere.yaml" in p.message for p in problems)


def test_overrides_win_over_the_file_and_report_the_command_line(tmp_path):
    recipe = write(tmp_path / "r.yaml", BASE)
    loaded = load_recipe(recipe, ["optimizer.lr=5e-4", "batch.micro_batch=auto", "model.lora.r=8"])
    assert loaded.recipe.optimizer.lr == 5e-4
    assert loaded.recipe.batch.micro_batch == "auto"
    assert loaded.recipe.model.lora.r == 8
    assert loaded.sources.where(("optimizer", "lr")) == (COMMAND_LINE, None)
    problems = problems_of(lambda: load_recipe(recipe, ["optimizer.lr=7", "train.steps=many"]))
    assert {(p.file, p.key) for p in problems} == {(COMMAND_LINE, "optimizer.lr"), (COMMAND_LINE, "train.steps")}


def test_model_path_on_the_command_line_replaces_the_recipes_preset_and_the_other_way_round(tmp_path):
    """README's `memtrain run recipes/llama2-7b-lora-24gb.yaml model.path=/models/llama-2-7b` was refused: the
    recipe's model.preset stayed beside the override. Both on the command line stay a conflict."""
    shipped = Path(__file__).parents[2] / "recipes" / "llama2-7b-lora-24gb.yaml"
    model_dir = tmp_path / "llama"
    model_dir.mkdir()
    loaded = load_recipe(shipped, [f"model.path={model_dir}"], check=False)
    assert loaded.recipe.model.path == str(model_dir) and loaded.recipe.model.preset is None
    assert loaded.recipe.model.lora.r == 16  # the rest of the model section stays the recipe's
    pathed = write(tmp_path / "pathed.yaml", BASE.replace("preset: tiny", f"path: {model_dir}"))
    assert load_recipe(pathed, ["model.preset=tiny"], check=False).recipe.model.path is None
    both = problems_of(lambda: load_recipe(shipped, [f"model.path={model_dir}", "model.preset=tiny"]))
    assert any("exactly one of model.preset or model.path" in p.message for p in both)


def test_an_override_reaches_into_a_list_by_index(tmp_path):
    """`data.train.1.weight=2` was refused ('data.train' is a value, not a section), so changing one
    dataset of a list meant copying the recipe."""
    recipe = write(
        tmp_path / "r.yaml",
        BASE.replace(
            "  train: builtin:shakespeare\n",
            "  train:\n    - path: builtin:shakespeare\n      type: text\n    - path: builtin:shakespeare-chat\n"
            "      type: chat\n",
        ),
    )
    loaded = load_recipe(
        recipe,
        ["data.train.1.weight=2", ("data.train.0={path: builtin:shakespeare, type: text, weight: 0.5}")],
        check=False,
    )
    assert [(spec.weight, spec.type) for spec in loaded.recipe.data.train] == [(0.5, "text"), (2.0, "chat")]
    assert loaded.sources.where(("data", "train", "1", "weight")) == (COMMAND_LINE, None)
    assert loaded.sources.where(("data", "train", "1", "type"))[1] == 8  # the file's line, kept
    problems = problems_of(
        lambda: load_recipe(recipe, ["data.train.2.weight=2", "data.train.first.weight=2", "data.seq_len.0=2"])
    )
    assert [(p.file, p.message, p.hint) for p in problems] == [
        (
            COMMAND_LINE,
            ("cannot set 'data.train.2.weight': 'data.train' is a list of 2, and '2' is not one of its indexes"),
            "use an index from 0 to 1",
        ),
        (
            COMMAND_LINE,
            (
                "cannot set 'data.train.first.weight': 'data.train' is a list of 2, and 'first' is not one "
                "of its indexes"
            ),
            "use an index from 0 to 1",
        ),
        (
            COMMAND_LINE,
            "cannot set 'data.seq_len.0': 'data.seq_len' is a value, not a section",
            "set data.seq_len=... instead",
        ),
    ]


def test_an_unknown_section_made_by_an_override_is_reported_at_the_command_line(tmp_path):
    recipe = write(tmp_path / "r.yaml", BASE)
    problems = problems_of(lambda: load_recipe(recipe, ["nonexistent.key=1", "model.nothing.deeper=2"]))
    assert {(p.file, p.line, p.key) for p in problems} == {
        (COMMAND_LINE, None, "nonexistent"),
        (COMMAND_LINE, None, "model.nothing"),
    }


def test_an_override_replacing_a_section_forgets_the_file_lines_below_it(tmp_path):
    recipe = write(tmp_path / "r.yaml", BASE)
    [problem] = problems_of(lambda: load_recipe(recipe, ["optimizer={lr: 2}"]))
    assert (problem.file, problem.key) == (COMMAND_LINE, "optimizer.lr")


def test_field_errors_and_contradictions_come_out_together():
    text = (
        BASE + "batch:\n  micro_batch: 0\nprecision:\n  compute: fp32\n  master: bf16\n"
        "offload:\n  params: cpu\n  zero_stage: 1\n"
    )
    problems = problems_of(lambda: load_recipe_text(text))
    assert {p.key for p in problems} == {"batch.micro_batch", "precision.master", "offload.zero_stage"}


def test_checks_that_read_a_broken_section_are_skipped_not_guessed():
    # global_batch is broken, so the gpus × micro_batch divisibility check must not run on a default
    text = BASE + "hardware:\n  gpus: 3\nbatch:\n  global_batch: -4\n  micro_batch: 4\n"
    [problem] = problems_of(lambda: load_recipe_text(text))
    assert problem.key == "batch.global_batch" and "at least 1" in problem.message


def test_problems_are_listed_in_reading_order():
    text = "train:\n  steps: 0\n" + BASE.replace("seq_len: 64", "seq_len: 1") + "bogus: 1\n"
    problems = problems_of(lambda: load_recipe_text(text))
    lines = [p.line for p in problems]
    assert lines == sorted(lines) and len(lines) == 3


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_shipped_recipe_validates(path):
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 0, result.output
    assert load_recipe(path).recipe.train.steps or load_recipe(path).recipe.train.epochs


# ---------------------------------------------------------------- JSON Schema


def _resolve(schema: dict, root: dict) -> dict:
    while "$ref" in schema:
        schema = root["$defs"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def schema_errors(value, schema: dict, root: dict, path: str = "") -> list[str]:
    """The subset of JSON Schema the recipe schema uses: $ref, anyOf, oneOf, type, enum/const, bounds, minItems,
    properties."""
    schema = _resolve(schema, root)
    if "anyOf" in schema:
        options = [schema_errors(value, option, root, path) for option in schema["anyOf"]]
        return [] if any(not errors for errors in options) else [f"{path}: matches no option"]
    if "oneOf" in schema:
        matching = sum(not schema_errors(value, option, root, path) for option in schema["oneOf"])
        return [] if matching == 1 else [f"{path}: matches {matching} options, not exactly one"]
    if "const" in schema and value != schema["const"]:
        return [f"{path}: {value!r} is not {schema['const']!r}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{path}: {value!r} not in {schema['enum']}"]
    kind = schema.get("type")
    checks = {
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "string": lambda v: isinstance(v, str),
        "boolean": lambda v: isinstance(v, bool),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "null": lambda v: v is None,
    }
    if kind and not checks[kind](value):
        return [f"{path}: {value!r} is not {kind}"]
    if "pattern" in schema and not re.search(schema["pattern"], value):
        return [f"{path}: {value!r} does not match {schema['pattern']}"]
    errors = []
    for bound, fails in [
        ("minimum", lambda v, b: v < b),
        ("maximum", lambda v, b: v > b),
        ("exclusiveMinimum", lambda v, b: v <= b),
        ("exclusiveMaximum", lambda v, b: v >= b),
    ]:
        if bound in schema and fails(value, schema[bound]):
            errors.append(f"{path}: {value!r} breaks {bound} {schema[bound]}")
    if "minItems" in schema and len(value) < schema["minItems"]:
        errors.append(f"{path}: fewer than {schema['minItems']} items")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for key, item in value.items():
            if key in properties:
                errors += schema_errors(item, properties[key], root, f"{path}.{key}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{path}.{key}: not allowed")
            elif isinstance(schema.get("additionalProperties"), dict):
                errors += schema_errors(item, schema["additionalProperties"], root, f"{path}.{key}")
        errors += [f"{path}.{key}: required" for key in schema.get("required", []) if key not in value]
    if isinstance(value, list):
        for index, item in enumerate(value):
            item_schema = (schema.get("prefixItems") or [])[index : index + 1] or [schema.get("items", {})]
            errors += schema_errors(item, item_schema[0], root, f"{path}.{index}")
    return errors


@pytest.fixture(scope="module")
def printed_schema() -> dict:
    result = CliRunner().invoke(app, ["schema"])
    assert result.exit_code == 0
    return json.loads(result.output)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_printed_schema_accepts_every_shipped_recipe(printed_schema, path):
    assert schema_errors(yaml.safe_load(path.read_text()), printed_schema, printed_schema) == []


def test_printed_schema_rejects_what_validation_rejects(printed_schema):
    recipe = yaml.safe_load(RECIPES[0].read_text())
    for section, key, value in [
        ("batch", "micro_batch", 0),
        ("batch", "micro_btch", 2),
        ("offload", "params", "disk"),
        ("hardware", "host_memory", "lots"),
        ("optimizer", "lr", 0),
    ]:
        broken = {**recipe, section: {**recipe.get(section, {}), key: value}}
        assert schema_errors(broken, printed_schema, printed_schema), (section, key, value)
    for size in ["64GiB", "16 GB", "1.5e9", 2**36]:
        assert schema_errors({**recipe, "hardware": {"host_memory": size}}, printed_schema, printed_schema) == []


def test_printed_schema_takes_data_as_validate_does(printed_schema):
    """A path, a list of datasets, or one dataset written as a mapping (RECIPES.md): editors using the schema
    accept what `validate` accepts, and refuse what it refuses."""
    recipe = yaml.safe_load(RECIPES[0].read_text())
    chat = {"path": "builtin:chat", "type": "chat"}
    for train, validation in [("builtin:shakespeare", None), ([chat], [chat]), (chat, {**chat, "weight": 2})]:
        data = {**recipe["data"], "train": train, **({"validation": validation} if validation else {})}
        load_recipe_text(yaml.safe_dump({**recipe, "data": data}))
        assert schema_errors({**recipe, "data": data}, printed_schema, printed_schema) == [], data
    for train in [[], 3, {"path": "builtin:chat"}, {**chat, "typo": 1}, [{**chat, "type": "poem"}]]:
        data = {**recipe["data"], "train": train}
        with pytest.raises(RecipeError):
            load_recipe_text(yaml.safe_dump({**recipe, "data": data}))
        assert schema_errors({**recipe, "data": data}, printed_schema, printed_schema), train


def test_input_paths_are_relative_to_the_file_that_names_them(tmp_path, monkeypatch):
    (tmp_path / "recipes" / "base").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "recipes" / "base" / "base.yaml").write_text(
        textwrap.dedent("""\
        model: {path: ../../models/m, tokenizer: builtin:shakespeare}
        data:
          train: [{path: ../../data/a.jsonl, type: chat}, {path: builtin:chat, type: chat}]
          validation: {path: /abs/v.jsonl, type: chat}
          cache_dir: cache
        train: {output_dir: runs/x}
        """)
    )
    child = tmp_path / "recipes" / "child.yaml"
    child.write_text("extends: base/base.yaml\nmodel: {tokenizer: tok}\n")
    monkeypatch.chdir(tmp_path / "elsewhere")
    loaded = load_recipe(
        Path("..") / "recipes" / "child.yaml", ["data.train=[{path: mine.jsonl, type: chat}]"], check=False
    )
    model, data = loaded.recipe.model, loaded.recipe.data
    assert model.path == str(tmp_path / "models" / "m")  # from base.yaml: relative to it
    assert model.tokenizer == str(tmp_path / "recipes" / "tok")  # from child.yaml: relative to it
    assert data.validation[0].path == "/abs/v.jsonl"
    assert data.train[0].path == str(tmp_path / "elsewhere" / "mine.jsonl")  # typed: the working directory's
    assert data.cache_dir == "cache" and loaded.recipe.train.output_dir == "runs/x"  # outputs: where the run starts
    kept = load_recipe(Path("..") / "recipes" / "child.yaml", check=False).recipe.data
    assert [d.path for d in kept.train] == [str(tmp_path / "data" / "a.jsonl"), "builtin:chat"]


def test_a_missing_relative_model_directory_is_named_resolved_at_its_line(tmp_path, monkeypatch):
    (tmp_path / "r").mkdir()
    recipe = tmp_path / "r" / "recipe.yaml"
    recipe.write_text(BASE.replace("  preset: tiny\n", "  path: ../no-such-model\n"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError) as caught:
        load_checked(Path("r/recipe.yaml"), [])
    problem = next(p for p in caught.value.problems if p.key == "model.path")
    assert (problem.file, problem.line) == ("r/recipe.yaml", 2)
    assert str(tmp_path / "no-such-model") in problem.message


def test_an_emptied_run_length_is_reported_at_the_key_that_was_emptied(tmp_path):
    recipe = write(tmp_path / "r.yaml", BASE)
    [problem] = problems_of(lambda: load_recipe(recipe, ["train.steps="]))
    assert (problem.file, problem.key) == (COMMAND_LINE, "train.steps")
    assert "has no value" in problem.message and "train.steps=1000" in problem.hint
    [problem] = problems_of(lambda: load_recipe_text(BASE.replace("steps: 10", "epochs:")))
    assert (problem.key, problem.line) == ("train.epochs", 10) and "train.epochs=3" in problem.hint
    [problem] = problems_of(lambda: load_recipe_text(BASE.replace("  steps: 10\n", "  seed: 1\n")))
    assert problem.key == "train" and "say how long to train" in problem.message  # nothing written: the section


@pytest.mark.parametrize(
    "value, shown", [("[0.9]", "[0.9]"), ("[]", "[]"), ("[0.9, 0.9, 0.9]", "[0.9, 0.9, 0.9]"), ("0.9", "0.9")]
)
def test_a_pair_given_the_wrong_number_of_values_is_one_problem_at_its_own_key(tmp_path, value, shown):
    recipe = write(tmp_path / "r.yaml", BASE)
    [problem] = problems_of(lambda: load_recipe(recipe, [f"optimizer.betas={value}"]))
    assert (problem.file, problem.key) == (COMMAND_LINE, "optimizer.betas")
    assert problem.message == f"must be a list of 2 numbers, got {shown}"
    assert "beta1, beta2" in problem.hint


def test_a_card_of_no_memory_is_refused_at_hardware_gpu():
    """'0GiB' looks like a size, and was planned against until its weights failed to fit a 0-byte card."""
    for size in ("0GiB", "0"):
        [problem] = problems_of(lambda size=size: load_recipe_text(BASE + f"hardware:\n  gpu: '{size}'\n"))
        assert problem.key == "hardware.gpu" and problem.line == 12  # the gpu: line
        assert f"a card of '{size}' has no memory to plan against: the size must be positive" in problem.message
    assert load_recipe_text(BASE + "hardware:\n  gpu: 16GiB\n").recipe.hardware.gpu == "16GiB"


@pytest.mark.parametrize("global_batch, gpus, micro_batch", [(15, 2, 8), (16, 3, 8), (12, 2, 4), (18, 2, 8), (6, 4, 2)])
def test_a_batch_hint_leads_to_a_recipe_that_validates(global_batch, gpus, micro_batch):
    """'lower batch.micro_batch to at most 7' for a global batch of 15 on 2 GPUs led to the next error
    ('not divisible by 2 × 7'). Whatever the hint says to set, set, validates."""
    overrides = [f"batch.global_batch={global_batch}", f"hardware.gpus={gpus}", f"batch.micro_batch={micro_batch}"]
    problems = problems_of(lambda: load_recipe_text(BASE, "r.yaml", overrides))
    assert len(problems) == 1 and problems[0].hint.startswith("use ")
    hint = problems[0].hint
    if "batch.micro_batch=" in hint:
        fixed = overrides[:2] + [re.search(r"batch\.micro_batch=\d+", hint).group(0)]
    else:
        multiple = int(re.search(r"multiple of (\d+)", hint).group(1))
        fixed = [f"batch.global_batch={multiple}", *overrides[1:]]  # the micro-batch kept
    assert load_recipe_text(BASE, "r.yaml", fixed).recipe.batch.global_batch % gpus == 0
