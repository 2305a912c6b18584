"""A model by Hub id end to end, offline from a Hugging Face cache the test lays out: train, pin the commit, resume,
refuse to resume on a moved branch, export the merged model and score it, all by `org/name`."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from memtrain.commands.eval import eval_command
from memtrain.commands.export import export_command
from memtrain.commands.run import run_command
from memtrain.errors import UserError
from memtrain.train.resolve import RunOptions
from tests.conftest import read_records
from tests.hub_cache import SHAKESPEARE_MINI, add_snapshot

pytestmark = pytest.mark.slow

LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


def test_a_hub_model_trains_resumes_on_its_commit_and_exports(write_recipe, hub_cache, tmp_path):
    commit = add_snapshot(hub_cache, "org/mini", SHAKESPEARE_MINI)
    recipe = write_recipe(
        "hub",
        {
            "model": {"preset": None, "tokenizer": None, "path": "org/mini", "lora": LORA},
            "data": {"train": "builtin:shakespeare", "validation": "builtin:shakespeare/validation", "seq_len": 32},
            "train": {"steps": 4, "eval_every": 100, "save_every": 2},
        },
    )
    run_dir = tmp_path / "runs" / "hub"
    assert run_command(recipe, [], RunOptions(max_steps=2)) == 0
    recorded = json.loads((run_dir / "run.json").read_text())["recipe"]["model"]
    assert recorded["path"] == "hub:org/mini" and recorded["revision"] == commit

    # main moves on to other weights: the checkpoint cannot follow, and says which commit it was trained on
    moved = add_snapshot(hub_cache, "org/mini", SHAKESPEARE_MINI, salt="moved")
    assert moved != commit
    with pytest.raises(UserError) as refused:
        run_command(recipe, [], RunOptions())
    said = "\n".join(p.format() for p in refused.value.problems)
    assert f'model.revision "{commit}" → "{moved}"' in said and f"pin model.revision={commit}" in said

    # pinned, it resumes where it stopped and ends
    assert run_command(recipe, [f"model.revision={commit}"], RunOptions()) == 0
    assert [r["step"] for r in read_records(run_dir, "train")] == [1, 2, 3, 4]
    assert (run_dir / "final" / "adapter_config.json").is_file()

    # the adapter merges onto the commit it was trained on (main names another one now), and scores
    out = io.StringIO()
    assert export_command(run_dir, merge=True, output=tmp_path / "merged", console=Console(file=out)) == 0
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    assert eval_command(run_dir, as_json=True, samples=0, limit=8, console=Console(file=out)) == 0
