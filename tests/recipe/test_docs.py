"""docs/RECIPES.md is the schema written out: committed text equals what the generator makes now."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from memtrain.recipe.schema import DatasetSpec, Recipe
from tests.recipe.sections import section_class

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_recipe_docs", ROOT / "scripts" / "gen_recipe_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fields(model: type[BaseModel], prefix: str = ""):
    for name, info in model.model_fields.items():
        yield f"{prefix}{name}", info
        nested = section_class(info.annotation)
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


def test_every_link_to_a_section_has_its_heading_and_every_section_lists_its_keys():
    generator = _generator()
    text = generator.render()
    headings = {line[3:].strip().lower() for line in text.splitlines() if line.startswith("## ")}
    links = set(re.findall(r"\]\(#([a-z0-9-]+)\)", text))
    assert links and links <= headings, f"dead links: {links - headings}"
    sections = generator._key_paths(Recipe, "", {})
    assert DatasetSpec in sections  # inside `str | list[DatasetSpec]`, the union that holds data.train
    for section in sections:
        body = text.split(f"\n## {section.__name__}\n", 1)[1].split("\n## ", 1)[0]
        for name in section.model_fields:
            assert f"| `{name}` |" in body, f"{section.__name__}.{name} is not in its section of docs/RECIPES.md"


def test_length_limits_read_as_characters_or_items():
    text = _generator().render()
    assert "items ≥" not in text
    assert "| `field` | str (at least 1 character) |" in text
    assert "list of str (at least 1 item)" in text


def test_help_prints_usage_and_writes_nothing(tmp_path, capsys):
    generator = _generator()
    generator.DOC = tmp_path / "RECIPES.md"
    with pytest.raises(SystemExit) as exited:
        generator.main(["--help"])
    assert exited.value.code == 0
    assert "--check" in capsys.readouterr().out
    assert not generator.DOC.exists()
