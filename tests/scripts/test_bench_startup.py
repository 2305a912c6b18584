"""scripts/bench_startup.py on the CPU: the quickstart recipe for one step with tiny overrides (not timed:
the columns are there and the phases add up to the time to the first step)."""

from __future__ import annotations

import csv

import pytest

from scripts import bench_startup as bench


def test_a_row_per_recipe_whose_phases_sum_to_the_first_step(tmp_path):
    out = tmp_path / "startup.csv"
    tiny = (
        "recipes/quickstart.yaml data.seq_len=32 batch.global_batch=2 batch.micro_batch=1 "
        "schedule.warmup_steps=0 train.steps=1 train.eval_batches=1"
    )
    assert (
        bench.main(
            [
                "--recipe",
                tiny,
                "--machine-state",
                "warm",
                "--out",
                str(out),
                "--steps",
                "1",
                "--runs",
                str(tmp_path / "runs"),
            ]
        )
        == 0
    )
    [row] = list(csv.DictReader(out.open()))
    assert list(row) == [
        "recipe",
        "machine_state",
        "first_step_s",
        "prepare_s",
        "launch",
        "load_recipe",
        "checks",
        "data",
        "plan",
        "workers",
        "process",
        "model",
        "cpu_adam_op",
        "deepspeed_init",
        "loaders",
        "loop_start",
        "eval_generate",
        "first_step",
        "machine",
        "date",
        "command",
    ]
    assert row["recipe"].startswith("quickstart data.seq_len=32") and row["machine_state"] == "warm"
    phases = [float(row[p]) for p in bench.PHASES if row[p] != ""]
    assert row["eval_generate"] == ""  # it ran no generation evaluation
    assert abs(sum(phases) - float(row["first_step_s"])) <= 0.1 * len(phases)  # each rounded to 0.1 s
    assert float(row["first_step_s"]) > 0 and float(row["deepspeed_init"]) > 0
    assert row["prepare_s"] == ""  # nothing prepared ahead


@pytest.mark.slow
def test_a_fresh_start_after_prepare_gives_its_seconds_apart_and_finds_what_it_built(tmp_path):
    out = tmp_path / "startup.csv"
    tiny = (
        "recipes/quickstart.yaml data.seq_len=32 batch.global_batch=2 batch.micro_batch=1 "
        "schedule.warmup_steps=0 train.steps=1 train.eval_batches=1"
    )
    assert (
        bench.main(
            [
                "--recipe",
                tiny,
                "--machine-state",
                "fresh",
                "--prepare",
                "--out",
                str(out),
                "--steps",
                "1",
                "--runs",
                str(tmp_path / "runs"),
            ]
        )
        == 0
    )
    [row] = list(csv.DictReader(out.open()))
    assert row["machine_state"] == "fresh" and row["command"].endswith(" --prepare")
    caches = tmp_path / "runs" / "fresh-caches"
    assert list((caches / "torch_extensions").glob("deepspeed_shm_comm/*.so"))  # built by prepare, in the fresh cache
    assert len(list((caches / "tokens").glob("*.tokens.npy"))) == 2  # training and validation text, tokenised once
    # the build (seconds on two cores) was prepare's; the run only loaded it
    assert float(row["prepare_s"]) > float(row["deepspeed_init"])
