"""The committed accuracy table says what the current planner predicts: its predicted columns are
recomputed here (as `scripts/plan_accuracy.py --replan` does) and must match, so a planner change
that moves a prediction cannot land without the table (and its view in docs/) moving with it."""
from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _harness():
    spec = importlib.util.spec_from_file_location("plan_accuracy", ROOT / "scripts" / "plan_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_accuracy_table_predictions_are_the_current_planners():
    harness = _harness()
    rows = list(csv.DictReader((ROOT / "benchmarks" / "plan_accuracy.csv").open()))
    cases = {case.name: case for case in harness.CASES}
    checked = 0
    for row in rows:
        case = cases.get(row["recipe"])
        if case is None:
            continue
        overrides = [*case.overrides, "hardware.gpu=rtx3090", "hardware.cap_memory=true", "train.steps=3",
                     "schedule.warmup_steps=1"]
        loaded = harness.load_recipe(ROOT / case.recipe, overrides, check=False)
        plan = harness.plan_recipe(loaded, "rtx3090", exact_pinned=False)  # the GPU machine's PyTorch 2.11
        assert row["predicted_reserved_gib"] == f"{plan.peak_reserved_bytes / 2**30:.2f}", row["recipe"]
        assert row["predicted_host_gib"] == f"{plan.host_bytes / 2**30:.1f}", row["recipe"]
        checked += 1
    assert checked >= 12


def test_accuracy_view_in_docs_is_rendered_from_the_csv():
    harness = _harness()
    rows = list(csv.DictReader((ROOT / "benchmarks" / "plan_accuracy.csv").open()))
    assert (ROOT / "docs" / "PLAN_ACCURACY.md").read_text() == harness.markdown(rows)
