"""scripts/bench_vs_hf.py's bookkeeping (the GPU runs are faked): one memtrain run per case, one row per
baseline, rows keyed by case and baseline, rows from before the `baseline` column read as `hf`."""

from __future__ import annotations

import csv

from scripts import bench_vs_hf as bench
from scripts.bench_common import ROOT
from scripts.suites import load_suites


def test_the_committed_table_says_which_baseline_each_row_ran_against():
    rows = list(csv.DictReader((ROOT / "benchmarks" / "vs_hf.csv").open()))
    assert rows and all(r["baseline"] in load_suites().baselines for r in rows)


def test_one_memtrain_run_and_a_row_per_baseline(tmp_path, monkeypatch):
    out = tmp_path / "vs_hf.csv"
    old = {c: "" for c in bench.COLUMNS if c != "baseline"} | {"recipe": "old-case", "ratio": "0.98"}
    with out.open("w", newline="") as stream:  # a table from before the baseline column
        writer = csv.DictWriter(stream, fieldnames=list(old))
        writer.writeheader()
        writer.writerow(old)
    ours_runs, theirs_runs = [], []

    def memtrain_side(recipe, overrides, steps, warmup, run_dir, timeout):
        ours_runs.append(recipe)
        return {
            "tokens_per_s": 8000.0,
            "target_tokens_per_s": 3000.0,
            "peak_reserved_gib": 15.7,
            "host_peak_rss_gib": 2.2,
            "first_step_s": 20.0,
            "setup": "mb 4, every_layer, expandable, liger kernels",
        }

    names = {baseline: name for name, baseline in load_suites().baselines.items()}

    def baseline_side(baseline, recipe, overrides, steps, warmup, result, timeout):
        theirs_runs.append(names[baseline])
        return {
            "tokens_per_s": {"hf": 6000.0, "hf-liger": 8000.0}[names[baseline]],
            "target_tokens_per_s": 2000.0,
            "peak_reserved_gib": 16.0,
            "host_peak_rss_gib": 2.2,
            "time_to_first_step_s": 20.0,
        }

    monkeypatch.setattr(bench, "memtrain_side", memtrain_side)
    monkeypatch.setattr(bench, "baseline_side", baseline_side)
    monkeypatch.setattr(bench, "prebuild_cpu_adam", lambda: None)
    argv = [
        "--out",
        str(out),
        "--runs",
        str(tmp_path / "runs"),
        "--baseline",
        "hf,hf-liger",
        "--case",
        "7b=recipes/llama2-7b-lora-24gb.yaml",
    ]
    assert bench.main(argv) == 0
    assert ours_runs == ["recipes/llama2-7b-lora-24gb.yaml"] and theirs_runs == ["hf", "hf-liger"]
    rows = {(r["recipe"], r["baseline"]): r for r in csv.DictReader(out.open())}
    assert set(rows) == {("old-case", "hf"), ("7b", "hf"), ("7b", "hf-liger")}
    assert rows[("7b", "hf")]["ratio"] == "1.33" and rows[("7b", "hf-liger")]["ratio"] == "1.00"
    assert "--baseline hf,hf-liger" in rows[("7b", "hf")]["command"]
    assert "| 7b | hf-liger |" in out.with_suffix(".md").read_text()
    bench.main(argv[:5] + ["hf-liger"] + argv[6:])  # a rerun of one baseline replaces only its row
    assert len(list(csv.DictReader(out.open()))) == 3


def test_the_setup_column_says_whether_the_compiled_layers_replayed_cuda_graphs():
    """The row names what memtrain resolved: the same shape launched and replayed must not read alike."""
    recipe = {
        "checkpointing": {"strategy": "none"},
        "hardware": {"expandable_segments": True},
        "model": {"kernels": "liger_loss"},
        "train": {"compile": True, "cuda_graphs": True},
    }
    start = {"micro_batch": 1}
    assert bench._setup(start, recipe) == "mb 1, none, expandable, compiled layers as CUDA graphs, liger loss"
    recipe["train"]["cuda_graphs"] = False
    assert bench._setup(start, recipe) == "mb 1, none, expandable, compiled layers, liger loss"
