"""The preference quickstart end to end on DeepSpeed's CPU accelerator: held-out reward accuracy rises well above
a coin's, and the greedy answers' exact match does not fall."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from memtrain.commands.eval import eval_command
from memtrain.commands.run import run_command
from memtrain.train.resolve import RunOptions
from tests.conftest import ROOT, read_records

pytestmark = pytest.mark.slow

# Measured on two CPU cores (recipes/quickstart-dpo.yaml as shipped, docs/REFERENCE.md): held-out reward accuracy
# over all 300 held-out pairs 0.790 at step 300 (seed 1234) and 0.783 (seed 7), 0.66-0.67 at step 100; exact match
# 0.00 at step 0 and 0.00-0.04 at the end. The floor is the quickstart's promise, 0.70: eight points below what two
# seeds reached, which lie within a point of each other, so another machine's arithmetic has room.
FLOOR = 0.70


def test_dpo_quickstart_reward_accuracy_rises_and_exact_match_holds(tmp_path):
    recipe = ROOT / "recipes" / "quickstart-dpo.yaml"
    run_dir = tmp_path / "quickstart-dpo"
    overrides = [f"train.output_dir={run_dir}", f"data.cache_dir={tmp_path / 'cache'}"]
    assert run_command(recipe, overrides, RunOptions()) == 0
    evals = read_records(run_dir, "eval")
    assert [e["step"] for e in evals] == [0, 100, 200, 300]
    assert evals[0]["reward_accuracy"] == 0  # the policy is its reference: every reward a tie
    assert evals[-1]["reward_accuracy"] >= FLOOR, [e["reward_accuracy"] for e in evals]
    scores = read_records(run_dir, "generation")
    assert [s["step"] for s in scores] == [0, 300] and scores[0]["total"] == scores[-1]["total"] == 100
    assert scores[-1]["exact_match"] >= scores[0]["exact_match"], (scores[0]["by_task"], scores[-1]["by_task"])
    # `memtrain eval` scores the exported adapter on the same held-out pairs as the run's last evaluation
    out = io.StringIO()
    assert eval_command(run_dir, as_json=True, samples=3, limit=100, console=Console(file=out)) == 0
    result = json.loads(out.getvalue())
    assert result["reward_accuracy"] == pytest.approx(evals[-1]["reward_accuracy"])
    assert result["exact_match"] == pytest.approx(scores[-1]["exact_match"])
