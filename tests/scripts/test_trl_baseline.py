"""scripts/trl_baseline.py: TRL's SFTTrainer gets memtrain's samples with memtrain's targets, packs them itself,
and the script reports real and target tokens/s as memtrain's records count them."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memtrain.labels import IGNORE_INDEX
from memtrain.recipe.load import load_recipe
from memtrain.train.runtime.distributed import without_rank_variables
from memtrain.train.setup import build_data

pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[2]
CHAT_RECIPE = """\
model: {{preset: mini, tokenizer: "builtin:shakespeare-chat", lora: {{r: 8}}}}
data:
  train: [{{path: "builtin:chat/validation", type: chat}}]
  template: chatml
  seq_len: 128
  packing: {packing}
  cache_dir: {cache}
hardware: {{gpus: 1}}
checkpointing: {{strategy: none}}
precision: {{compute: fp32}}
batch: {{global_batch: 4, micro_batch: 2}}
train: {{steps: 2, output_dir: {runs}}}
"""


@pytest.fixture(scope="module")
def trl_baseline():
    spec = importlib.util.spec_from_file_location("trl_baseline", ROOT / "scripts" / "trl_baseline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def chat_recipe(tmp_path: Path, packing: bool = True) -> Path:
    path = tmp_path / f"chat-{packing}.yaml"
    path.write_text(CHAT_RECIPE.format(packing=str(packing).lower(), cache=tmp_path / "cache", runs=tmp_path / "runs"))
    return path


@pytest.mark.parametrize("packing", [True, False])
def test_trl_gets_every_sample_with_memtrains_targets(trl_baseline, tmp_path, packing):
    rows = build_data(load_recipe(chat_recipe(tmp_path, packing)).recipe).train_set
    samples = trl_baseline.samples_of(rows)
    assert len(samples["input_ids"]) == rows.stats.samples
    assert sum(len(ids) for ids in samples["input_ids"]) == rows.stats.tokens
    # the loss's tokens are memtrain's: prompts and each sample's first token are -100
    targets = sum(sum(label != IGNORE_INDEX for label in labels) for labels in samples["labels"])
    assert targets == rows.targets(range(len(rows))) == rows.stats.target_tokens
    assert all(labels[0] == IGNORE_INDEX for labels in samples["labels"])
    assert all(len(a) == len(b) for a, b in zip(samples["input_ids"], samples["labels"]))


@pytest.mark.slow
def test_trl_trains_two_steps_on_the_cpu_and_writes_its_row(tmp_path):
    out, table = tmp_path / "result.json", tmp_path / "trl.csv"
    command = [sys.executable, "scripts/trl_baseline.py", str(chat_recipe(tmp_path)), "--steps", "3"]
    command += ["--warmup", "0", "--out", str(out), "--csv", str(table)]
    env = without_rank_variables(os.environ)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["baseline"] == "trl" and result["steps"] == 3
    # real tokens are every token of the packed samples; targets the responses alone
    assert 0 < result["target_tokens_per_s"] < result["tokens_per_s"]
    assert 0 <= result["padding_share"] < 0.2  # TRL's padding-free packing computes almost no padding
    rows = list(csv.DictReader(table.open()))
    assert len(rows) == 1 and rows[0]["baseline"] == "trl" and rows[0]["machine"] == "cpu"
    assert rows[0]["command"].startswith("python scripts/trl_baseline.py")


def test_a_text_recipe_is_refused_with_the_key(tmp_path):
    recipe = tmp_path / "text.yaml"
    recipe.write_text(
        'model: {preset: tiny, lora: {r: 8}}\ndata: {train: "builtin:shakespeare", seq_len: 64, '
        f"cache_dir: {tmp_path / 'cache'}}}\nbatch: {{global_batch: 4, micro_batch: 2}}\ntrain: {{steps: 1}}\n"
    )
    command = [sys.executable, "scripts/trl_baseline.py", str(recipe), "--out", str(tmp_path / "r.json")]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "data.train" in done.stderr and "Traceback" not in done.stderr
