"""Models by Hub id, read offline from a Hugging Face cache the test lays out as huggingface_hub does."""

from __future__ import annotations

import json

import yaml
from typer.testing import CliRunner

from memtrain.cli import app
from memtrain.recipe.load import load_recipe
from tests.hub_cache import SHAKESPEARE_MINI, add_snapshot

RECIPE = {
    "model": {"path": "org/mini"},
    "data": {"train": "builtin:shakespeare", "seq_len": 64},
    "batch": {"global_batch": 8, "micro_batch": 4},
    "precision": {"compute": "fp32"},
    "train": {"steps": 4},
}


def write(tmp_path, model: dict, name: str = "hub.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump({**RECIPE, "model": model}))
    return path


def test_an_id_that_is_no_path_is_read_as_hub_id_and_a_path_that_exists_wins(tmp_path, hub_cache):
    assert load_recipe(write(tmp_path, {"path": "org/mini"})).recipe.model.path == "hub:org/mini"
    (tmp_path / "org" / "mini").mkdir(parents=True)  # a directory of that name beside the recipe wins
    assert load_recipe(write(tmp_path, {"path": "org/mini"})).recipe.model.path == str(tmp_path / "org" / "mini")
    forced = load_recipe(write(tmp_path, {"path": "hub:org/mini"})).recipe.model.path
    assert forced == "hub:org/mini"  # hub: forces the Hub whatever is on disk


def test_validate_and_plan_read_the_config_alone_from_the_cache(tmp_path, hub_cache):
    """A cache holding only config.json: plan and validate need no more (never the weights)."""
    add_snapshot(hub_cache, "org/mini", SHAKESPEARE_MINI, files=("config.json",))
    recipe = write(tmp_path, {"path": "org/mini"})
    runner = CliRunner()
    validated = runner.invoke(app, ["validate", str(recipe)])
    assert validated.exit_code == 0, validated.output
    planned = runner.invoke(app, ["plan", str(recipe), "--json"])
    assert planned.exit_code == 0, planned.output
    local = runner.invoke(app, ["plan", str(write(tmp_path, {"path": str(SHAKESPEARE_MINI)}, "local.yaml")), "--json"])
    by_id, by_path = json.loads(planned.stdout)["plan"], json.loads(local.stdout)["plan"]
    assert by_id["params_total"] == by_path["params_total"] == 1_856_640  # shakespeare-mini's, from its config.json
    assert by_id["peak_reserved_bytes"] == by_path["peak_reserved_bytes"]
    snapshot = next((hub_cache / "models--org--mini" / "snapshots").iterdir())
    assert sorted(p.name for p in snapshot.iterdir()) == ["config.json"]


def test_a_missing_id_is_one_clear_message_and_exit_2(tmp_path, hub_cache):
    recipe = write(tmp_path, {"path": "org/nothing-here"})
    result = CliRunner().invoke(app, ["validate", str(recipe)])
    assert result.exit_code == 2
    out = " ".join(result.output.split())
    assert "org/nothing-here" in out and "HF_HUB_OFFLINE" in out and "HF_TOKEN" in out
    assert "hub.yaml:" in out  # at the recipe's line
    assert "Traceback" not in result.output


def test_a_revision_the_cache_lacks_is_said_and_one_it_holds_is_read(tmp_path, hub_cache):
    commit = add_snapshot(hub_cache, "org/mini", SHAKESPEARE_MINI, files=("config.json",))
    runner = CliRunner()
    held = runner.invoke(app, ["validate", str(write(tmp_path, {"path": "org/mini", "revision": commit}))])
    assert held.exit_code == 0, held.output
    lacking = runner.invoke(app, ["validate", str(write(tmp_path, {"path": "org/mini", "revision": "v2"}))])
    assert lacking.exit_code == 2 and "at revision 'v2'" in " ".join(lacking.output.split())


def test_a_revision_needs_a_hub_id(tmp_path):
    result = CliRunner().invoke(
        app, ["validate", str(write(tmp_path, {"path": str(SHAKESPEARE_MINI), "revision": "main"}))]
    )
    assert result.exit_code == 2
    assert "model.revision is for a model read from the Hugging Face Hub" in " ".join(result.output.split())
