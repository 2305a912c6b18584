"""Property-based tests: whatever YAML comes in, the loader answers with a recipe or a RecipeError.

Random recipes are built from the schema's own keys (so they reach deep into validation and the
cross-field checks), mixed with unknown keys, random values and plain garbage text.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from memtrain.errors import RecipeError
from memtrain.recipe.load import load_recipe_text
from memtrain.recipe.schema import Recipe
from tests.recipe.sections import section_class

QUICKSTART = (Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml").read_text()
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**12),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(
        [
            "auto",
            "none",
            "cpu",
            "nvme",
            "bf16",
            "fp16",
            "fp32",
            "24GiB",
            "tiny",
            "builtin:shakespeare",
            "rtx3090",
            "every_layer",
            "rules",
            "3",
            "-1",
        ]
    ),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def section_strategy(model: type[BaseModel], depth: int = 0) -> st.SearchStrategy[dict]:
    """Random mappings over a section's known keys (sub-sections recursively), plus an odd unknown key."""
    fields = {}
    for name, info in model.model_fields.items():
        nested = section_class(info.annotation)
        fields[name] = st.one_of(section_strategy(nested, depth + 1), values) if nested and depth < 2 else values
    known = st.fixed_dictionaries({}, optional=fields)
    unknown = st.dictionaries(st.text(min_size=1, max_size=8), values, max_size=1)
    return st.builds(lambda a, b: {**b, **a}, known, unknown)


def assert_recipe_or_recipe_error(text: str) -> None:
    try:
        loaded = load_recipe_text(text)
    except RecipeError as error:
        assert error.problems, "a RecipeError always says what is wrong"
        for problem in error.problems:
            assert problem.message
    else:
        assert isinstance(loaded.recipe, Recipe)


@SETTINGS
@given(section_strategy(Recipe))
def test_random_recipes_validate_or_raise_recipe_error(data):
    assert_recipe_or_recipe_error(yaml.safe_dump(data, allow_unicode=True))


@SETTINGS
@given(st.text(max_size=200))
def test_garbage_text_validates_or_raises_recipe_error(text):
    assert_recipe_or_recipe_error(text)


@SETTINGS
@given(st.lists(st.sampled_from(QUICKSTART.splitlines()), max_size=30), st.text(max_size=20))
def test_shuffled_recipe_lines_validate_or_raise_recipe_error(lines, noise):
    # real keys at the wrong indentation or in the wrong section, plus a little noise
    assert_recipe_or_recipe_error("\n".join(lines) + noise)


@SETTINGS
@given(st.lists(st.text(max_size=30), max_size=4))
def test_random_overrides_validate_or_raise_recipe_error(overrides):
    try:
        load_recipe_text(QUICKSTART, overrides=overrides)
    except RecipeError as error:
        assert error.problems


def _render(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


valid_overrides = st.fixed_dictionaries(
    {},
    optional={
        "optimizer.lr": st.floats(1e-6, 0.5),
        "optimizer.weight_decay": st.floats(0, 1),
        "train.seed": st.integers(0, 2**31),
        "train.steps": st.integers(20, 10**6),
        "data.seq_len": st.integers(8, 2048),
        "data.packing": st.booleans(),
        "schedule.decay": st.sampled_from(["cosine", "linear", "constant"]),
        "precision.fp32_modules": st.lists(st.sampled_from(["*norm*", "lm_head", "model.embed_tokens"]), max_size=3),
        "hardware.host_memory": st.integers(1, 2**40),
        "batch.adaptive.grow_factor": st.floats(1.01, 4),
    },
)


@SETTINGS
@given(valid_overrides, st.sampled_from([(16, 8), (16, 4), (32, 2), (8, "auto")]))
def test_valid_overrides_round_trip(overrides, batch):
    global_batch, micro_batch = batch
    overrides = {**overrides, "batch.global_batch": global_batch, "batch.micro_batch": micro_batch}
    loaded = load_recipe_text(QUICKSTART, overrides=[f"{key}={_render(value)}" for key, value in overrides.items()])
    dumped = loaded.recipe.model_dump()
    for key, value in overrides.items():
        node = dumped
        for part in key.split("."):
            node = node[part]
        assert node == value, key
        assert loaded.sources.where(tuple(key.split("."))) == ("<command line>", None)
    # and the resolved recipe, written back as YAML, loads to the same recipe
    again = load_recipe_text(yaml.safe_dump(loaded.recipe.model_dump(exclude_none=True)))
    assert again.recipe == loaded.recipe
