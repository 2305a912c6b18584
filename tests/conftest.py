"""Shared test setup: DeepSpeed on its CPU accelerator, and helpers to write and run tiny recipes."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]

# A recipe small enough to train in seconds on two CPU cores, on the bundled Shakespeare.
TINY_RECIPE = {
    "model": {"preset": "micro", "tokenizer": "builtin:shakespeare"},
    "data": {"train": "builtin:shakespeare", "validation": "builtin:shakespeare/validation", "seq_len": 32},
    "hardware": {"gpus": 1},
    "checkpointing": {"strategy": "none"},
    "precision": {"compute": "fp32"},
    "batch": {"global_batch": 8, "micro_batch": 4},
    "optimizer": {"lr": 3.0e-3},
    "schedule": {"warmup_steps": 2, "decay": "cosine"},
    "train": {"steps": 10, "eval_every": 5, "eval_batches": 2, "save_every": 5, "log_every": 1, "seed": 7},
}


def deep_update(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = deep_update(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@pytest.fixture
def write_recipe(tmp_path):
    """write_recipe(name, {section: {...}}) -> path of a tiny recipe whose run dir is under tmp_path."""

    def write(name: str = "tiny", extra: dict | None = None) -> Path:
        recipe = deep_update(TINY_RECIPE, extra or {})
        recipe = deep_update(recipe, {"train": {"output_dir": str(tmp_path / "runs" / name)},
                                      "data": {"cache_dir": str(tmp_path / "cache")}})
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        return path

    return write


def read_records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_records(run_dir, "train")}
