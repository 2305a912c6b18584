"""Preference runs through `memtrain run` on the CPU (real DeepSpeed): DPO under LoRA (the reference is the model
with its adapters disabled) and as a full fine-tune (a precomputed reference), the first step's loss ln 2, the
reward metrics in metrics.jsonl, and a run stopped and resumed equal to the uninterrupted one."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from memtrain.commands.run import run_command
from memtrain.train.resolve import RunOptions
from memtrain.train.score_run import evaluate_run
from tests.conftest import read_records, train_losses

pytestmark = pytest.mark.slow

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def pairs_file(tmp_path: Path) -> Path:
    """Arithmetic pairs as plain strings: the right sum chosen, one more rejected."""
    path = tmp_path / "pairs.jsonl"
    records = [
        {"prompt": f"Add {a} and {b}:", "chosen": f" {a + b}.", "rejected": f" {a + b + 1}."}
        for a in range(10)
        for b in range(8)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def dpo_recipe(tmp_path: Path, *, lora: bool, steps: int = 6) -> dict:
    path = str(pairs_file(tmp_path))
    return {
        "model": {"preset": "micro", "tokenizer": "builtin:shakespeare", **({"lora": LORA} if lora else {})},
        "data": {
            "train": [{"path": path, "type": "preference"}],
            "validation": None,
            "validation_fraction": 0.1,
            "seq_len": 32,
        },
        "batch": {"global_batch": 8, "micro_batch": 4},
        "optimizer": {"lr": 1.0e-2},
        "train": {"steps": steps, "save_every": steps // 2, "eval_every": steps // 2, "objective": "dpo"},
    }


def test_lora_dpo_starts_at_ln2_and_logs_its_rewards(write_recipe, tmp_path):
    recipe = write_recipe("lora", dpo_recipe(tmp_path, lora=True))
    assert run_command(recipe, []) == 0
    run_dir = tmp_path / "runs" / "lora"
    records = read_records(run_dir, "train")
    assert abs(records[0]["loss"] - math.log(2)) < 1e-6  # fresh adapters: the policy is its reference
    assert records[0]["reward_margin"] == pytest.approx(0.0, abs=1e-6)
    for key in ("reward_chosen", "reward_rejected", "reward_accuracy", "logp_chosen", "logp_rejected"):
        assert all(key in r for r in records), key
    assert abs(records[-1]["reward_margin"]) > 1e-4  # the adapters moved the policy away from its reference
    evals = read_records(run_dir, "eval")
    assert len(evals) == 2 and all("reward_accuracy" in e and "reward_margin" in e for e in evals)
    assert "perplexity" not in evals[0]
    assert not (tmp_path / "cache" / "reference").exists()  # adapters_off: nothing precomputed


def test_full_dpo_precomputes_its_reference_once_and_resumes_exactly(write_recipe, tmp_path):
    """The precomputed reference is the initial model: the first loss is ln 2 as with the policy itself. A run
    stopped at step 3 and resumed reads the stored log-probabilities and equals the uninterrupted run."""
    extra = dpo_recipe(tmp_path, lora=False)
    straight = write_recipe("straight", extra)
    assert run_command(straight, []) == 0
    assert len(list((tmp_path / "cache" / "reference").glob("*.npy"))) == 2  # training and validation pairs
    written = {p: p.stat().st_mtime_ns for p in (tmp_path / "cache" / "reference").glob("*.npy")}
    a = train_losses(tmp_path / "runs" / "straight")
    assert abs(a[1] - math.log(2)) < 1e-6

    halves = write_recipe("halves", extra)
    assert run_command(halves, [], RunOptions(max_steps=3)) == 0
    assert run_command(halves, []) == 0
    b = train_losses(tmp_path / "runs" / "halves")
    assert sorted(b) == list(range(1, 7))
    for step in a:
        assert b[step] == pytest.approx(a[step], abs=1e-6), step
    assert {p: p.stat().st_mtime_ns for p in written} == written  # read, not computed again
    ra = read_records(tmp_path / "runs" / "straight", "train")
    rb = read_records(tmp_path / "runs" / "halves", "train")
    assert [r["reward_accuracy"] for r in ra] == [r["reward_accuracy"] for r in rb]
    weights_a = load_file(tmp_path / "runs" / "straight" / "final" / "model.safetensors")
    weights_b = load_file(tmp_path / "runs" / "halves" / "final" / "model.safetensors")
    assert all(torch.allclose(weights_a[k], weights_b[k], atol=1e-6) for k in weights_a)

    # memtrain eval RUN_DIR scores the held-out pairs again against the stored reference: the run's last eval
    scored = evaluate_run(tmp_path / "runs" / "straight").as_json()
    last = read_records(tmp_path / "runs" / "straight", "eval")[-1]
    assert scored["loss"] == pytest.approx(last["loss"], abs=1e-5)
    assert scored["reward_accuracy"] == pytest.approx(last["reward_accuracy"])
    assert scored["reward_margin"] == pytest.approx(last["reward_margin"], abs=1e-5)
    assert scored["perplexity"] is None and scored["exact_match"] is None  # text pairs: no conversation to ask


def kto_file(tmp_path: Path) -> Path:
    path = tmp_path / "kto.jsonl"
    records = [
        {"prompt": f"Add {a} and {b}:", "completion": f" {a + b + (a + b) % 2}.", "label": (a + b) % 2 == 0}
        for a in range(10)
        for b in range(8)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("objective", ["simpo", "orpo", "kto"])
def test_the_other_objectives_train_and_log(write_recipe, tmp_path, objective):
    """SimPO and ORPO (no reference) under LoRA, KTO as a full fine-tune with its precomputed reference: a few
    steps that move the loss and log the rewards, the batch counting pairs (KTO: records)."""
    extra = dpo_recipe(tmp_path, lora=objective != "kto", steps=4)
    extra["train"]["objective"] = objective
    if objective == "kto":
        extra["data"]["train"] = [{"path": str(kto_file(tmp_path)), "type": "kto"}]
    recipe = write_recipe(objective, extra)
    assert run_command(recipe, []) == 0
    records = read_records(tmp_path / "runs" / objective, "train")
    assert len(records) == 4 and all(math.isfinite(r["loss"]) for r in records)
    assert all("reward_chosen" in r and "reward_rejected" in r for r in records)
    # the global batch counts pairs (KTO: records), each two rows (KTO: the answer and its mismatched KL row), so a
    # step reads 2 x 8 rows: its tokens are 16 rows' worth at the data's mean, not the 8 rows a row count would read
    data = read_records(tmp_path / "runs" / objective, "run")[0]["data"]
    assert data["rows"] == 2 * data["samples"]
    last = records[-1]
    for field in ("tokens", "target_tokens"):
        assert last[field] / 4 == pytest.approx(2 * 8 * data[field] / data["rows"], rel=0.2), field
    assert last["target_tokens"] < last["tokens"] <= last["padded_tokens"] <= 4 * 2 * 8 * 32
    if objective == "kto":
        assert abs(records[0]["loss"] - 0.5) < 1e-6  # reference = policy and z = 0: 1 - sigmoid(0) per record
        assert len(list((tmp_path / "cache" / "reference").glob("*.npy"))) == 2
    else:
        assert not (tmp_path / "cache" / "reference").exists()


@pytest.mark.parametrize("lora", [True, False], ids=["lora-adapters-off", "full-precomputed"])
def test_dpo_laid_out_packed_trains_the_pairs_layouts_losses_in_fewer_micro_batches(
    write_recipe, tmp_path, monkeypatch, lora
):
    """What a GPU run does with pairs (varlen attention, each step's pairs laid end to end: data/rows/pairs.py),
    forced on the CPU, where sdpa keeps a row's sequences apart with its mask: the same pairs in the same steps,
    the same losses, rewards and validation, in fewer micro-batches, with both references (the adapters disabled
    on the packed batch, and log-probabilities precomputed on the pairs layout)."""
    extra = dpo_recipe(tmp_path, lora=lora, steps=4)
    if lora:
        extra["model"]["lora"] = {**LORA, "dropout": 0.0}  # no random masks, which the layouts would draw apart
    extra["data"]["group_by_length"] = False  # as laid-out steps are ordered
    extra["precision"] = {"compute": "fp32"}  # the two layouts round alike: equal to fp32's tolerance
    assert run_command(write_recipe("rows", extra), []) == 0
    import memtrain.train.launch as launch  # noqa: PLC0415
    import memtrain.train.setup as setup  # noqa: PLC0415

    monkeypatch.setattr(setup, "packs_steps", lambda recipe: True)
    monkeypatch.setattr(launch, "packs_steps", lambda recipe: True)
    shutil.rmtree(tmp_path / "cache" / "reference", ignore_errors=True)  # computed again, on packed batches
    assert run_command(write_recipe("laid", extra), []) == 0
    assert lora or any((tmp_path / "cache" / "reference").glob("*.npy"))
    runs = tmp_path / "runs"
    rows, laid = read_records(runs / "rows", "train"), read_records(runs / "laid", "train")
    assert [r["step"] for r in rows] == [r["step"] for r in laid] == [1, 2, 3, 4]
    for a, b in zip(rows, laid, strict=True):
        # (not the reward accuracy: at step 1 every reward is 0 up to rounding, which decides it either way)
        for key in ("loss", "reward_margin", "logp_chosen", "logp_rejected"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
    assert sum(r["grad_accum"] for r in laid) < sum(r["grad_accum"] for r in rows) == 4 * 2
    assert laid[-1]["tokens"] == rows[-1]["tokens"] and laid[-1]["padded_tokens"] % 64 == 0  # rows of 2 x 32
    evals = [read_records(runs / name, "eval")[-1] for name in ("rows", "laid")]
    assert evals[1]["loss"] == pytest.approx(evals[0]["loss"], rel=1e-4)
