"""docs/RECIPES.md is the schema written out: committed text equals what the generator makes now."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from pydantic import BaseModel

from memtrain.recipe.messages import _section_class
from memtrain.recipe.schema import Recipe

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_recipe_docs", ROOT / "scripts" / "gen_recipe_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fields(model: type[BaseModel], prefix: str = ""):
    for name, info in model.model_fields.items():
        yield f"{prefix}{name}", info
        nested = _section_class(info.annotation)
        if nested is not None:
            yield from _fields(nested, f"{prefix}{name}.")


def test_committed_reference_equals_the_generated_one():
    committed = (ROOT / "docs" / "RECIPES.md").read_text()
    assert committed == _generator().render(), "run: python scripts/gen_recipe_docs.py"


def test_every_key_is_described_and_documented():
    text = _generator().render()
    keys = list(_fields(Recipe))
    assert len(keys) > 60
    for key, info in keys:
        assert info.description, f"{key} has no description in memtrain/recipe/schema.py"
        assert f"| `{key.rsplit('.', 1)[-1]}` |" in text, key
