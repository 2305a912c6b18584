"""The committed accuracy table says what the current planner predicts: its predicted columns are
recomputed here (as `scripts/plan_accuracy.py --replan` does) and must match, so a planner change
that moves a prediction cannot land without the table (and its Markdown view beside it) moving with it."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from scripts import plan_accuracy as harness
from scripts.bench_common import ROOT

TABLES = [
    (True, "plan_accuracy.csv", "plan_accuracy.md"),
    (False, "plan_accuracy_caching.csv", "plan_accuracy_caching.md"),
]


def _rows(table: str) -> list[dict]:
    path = ROOT / "benchmarks" / table
    return list(csv.DictReader(path.open())) if path.exists() else []


@pytest.mark.slow  # 5-20 s on two cores: plain pytest stays under 2 minutes; scripts/test.sh (CI) runs it
@pytest.mark.parametrize("expandable, table, view", TABLES)
def test_accuracy_table_predictions_are_the_current_planners(expandable, table, view):
    cases = {case.name: case for case in harness.CASES}
    checked = 0
    for row in _rows(table):
        case = cases.get(row["recipe"])
        if case is None:
            continue
        overrides = harness.case_overrides(case, "rtx3090", Path("/tmp/runs"), Path("/tmp/nvme"), expandable)
        loaded = harness.load_recipe(ROOT / case.recipe, overrides, check=False)
        plan = harness.plan_recipe(loaded.recipe, "rtx3090", exact_pinned=False)  # the GPU machine's PyTorch 2.11
        predicted = harness.predicted_columns(plan)
        assert row["predicted_reserved_gib"] == predicted["predicted_reserved_gib"], row["recipe"]
        assert row["predicted_allocated_gib"] == predicted["predicted_allocated_gib"], row["recipe"]
        assert row["predicted_host_gib"] == predicted["predicted_host_gib"], row["recipe"]
        checked += 1
    assert checked >= 12


@pytest.mark.parametrize("expandable, table, view", TABLES)
def test_accuracy_view_beside_its_csv_is_rendered_from_the_csv(expandable, table, view):
    assert (ROOT / "benchmarks" / view).read_text() == harness.markdown(_rows(table), expandable)


def test_side_by_side_runs_keep_nvme_cases_alone(monkeypatch):
    """The accuracy harness runs cases in parallel within a host budget, but an NVMe case never shares the
    machine (one failed beside four others, a swap file missing at its read, and trained alone)."""
    import threading
    import time
    from types import SimpleNamespace

    lock, running, overlaps = threading.Lock(), set(), []

    def fake_measure(case, overrides, run_dir, timeout):  # the scheduling under test, not a GPU run
        with lock:
            running.add(case.name)
            overlaps.append(frozenset(running))
        time.sleep(0.05)
        with lock:
            running.discard(case.name)
        return {}

    monkeypatch.setattr(harness, "measure", fake_measure)
    cases = [c for c in harness.CASES if "nvme" in c.name][:1] + [c for c in harness.CASES if "lora" in c.name][:3]
    plan = SimpleNamespace(host_bytes=1)
    args = SimpleNamespace(host_budget_gib=100.0, parallel=4, runs=Path("/tmp"), timeout=1)
    done = []
    harness.run_cases([(c, [], plan) for c in cases], args, lambda case, plan, result: done.append(case.name))
    assert sorted(done) == sorted(c.name for c in cases)
    nvme = cases[0].name
    assert all(group == {nvme} for group in overlaps if nvme in group)
    assert any(len(group) > 1 for group in overlaps)  # the others still ran side by side
