"""scripts/hf_baseline.py on chat data: the Trainer gets memtrain's rows, in memtrain's order, in memtrain's
micro-batches, and transformers keeps the packed samples apart on the HF side as it does on memtrain's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from memtrain.data.rows.loader import collate, sample_order
from memtrain.labels import IGNORE_INDEX
from memtrain.model.config import model_config
from memtrain.model.wrapper import one_sequence
from memtrain.recipe.load import load_recipe
from memtrain.train.runtime.distributed import without_rank_variables
from memtrain.train.setup import build_data
from scripts import hf_baseline
from scripts.bench_common import ROOT

CHAT_RECIPE = """\
model: {{preset: mini, tokenizer: "builtin:shakespeare-chat"}}
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
train: {{steps: 3, output_dir: {runs}}}
"""


def chat_recipe(tmp_path: Path, packing: bool = True) -> Path:
    path = tmp_path / f"chat-{packing}.yaml"
    path.write_text(CHAT_RECIPE.format(packing=str(packing).lower(), cache=tmp_path / "cache", runs=tmp_path / "runs"))
    return path


@pytest.mark.parametrize("packing", [True, False])
def test_the_trainer_gets_memtrains_micro_batches_in_memtrains_order(tmp_path, packing):
    recipe = load_recipe(chat_recipe(tmp_path, packing)).recipe
    rows = build_data(recipe).train_set
    steps = 3
    loader = torch.utils.data.DataLoader(
        hf_baseline.RowIndices(len(rows)),
        batch_size=2,
        sampler=hf_baseline.RunOrder(recipe, rows, steps),
        collate_fn=hf_baseline.MemtrainBatches(rows, recipe.data.groups_by_length, "sdpa"),
    )
    order = sample_order(recipe.data, rows, recipe.train.seed, 4)
    expected = [
        collate(rows, order.indices(step * 4, 4)[half : half + 2], trim=not packing)
        for step in range(steps)
        for half in (0, 2)
    ]
    got = list(loader)
    assert len(got) == len(expected) == 6
    for a, b in zip(got, expected):
        assert a.keys() == b.keys() == {"input_ids", "labels", "position_ids"}
        assert all(torch.equal(a[k], b[k]) for k in a)
    if packing:  # rows of several conversations: positions restart, prompts are not targets
        assert any((b["position_ids"][:, 1:] == 0).any() for b in got)
    else:  # one conversation a row, cut to the longest of the micro-batch
        assert all(b["input_ids"].shape[1] < 128 for b in got)
    assert all((b["labels"] == IGNORE_INDEX).float().mean() > 0.3 for b in got)
    counts = hf_baseline.target_tokens_per_step(recipe, rows, steps)
    assert counts == [
        int((torch.cat([got[2 * s]["labels"], got[2 * s + 1]["labels"]])[:, 1:] != IGNORE_INDEX).sum())
        for s in range(steps)
    ]


def test_flash_attention_gets_the_rows_end_to_end_as_memtrain_lays_them(tmp_path):
    recipe = load_recipe(chat_recipe(tmp_path)).recipe
    rows = build_data(recipe).train_set
    batch = hf_baseline.MemtrainBatches(rows, False, "flash_attention_2")([0, 1])
    plain = collate(rows, [0, 1])
    expected = one_sequence(plain["input_ids"], plain["labels"], plain["position_ids"])
    assert batch["input_ids"].shape == (1, 256)
    assert all(torch.equal(batch[k], v) for k, v in zip(("input_ids", "labels", "position_ids"), expected))


def test_the_hf_model_keeps_packed_samples_apart_given_only_position_ids(tmp_path):
    """What the Trainer hands the model (input_ids, labels, position_ids; no attention_mask): each sample's
    logits in a packed row equal those of the sample run alone (use_cache off, as the script has it)."""
    recipe = load_recipe(chat_recipe(tmp_path)).recipe
    rows = build_data(recipe).train_set
    index = next(i for i in range(len(rows)) if len(rows.row(i)) >= 3)
    item = rows[index]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(recipe.model), dtype=torch.float32).eval()
    # as the script sets it: with a cache, transformers does not look for packed samples (masking_utils) and
    # the second sample would attend to the first
    model.config.use_cache = False
    with torch.no_grad():
        packed = model(input_ids=item["input_ids"][None], position_ids=item["position_ids"][None]).logits[0]
        starts = (item["position_ids"] == 0).nonzero().flatten().tolist()
        for start, end in zip(starts, starts[1:]):
            alone = model(input_ids=item["input_ids"][None, start:end]).logits[0]
            torch.testing.assert_close(packed[start:end], alone, atol=1e-5, rtol=1e-5)


def test_tokens_per_second_leave_the_warm_up_out():
    assert hf_baseline.per_second([10, 20, 30, 40], [1.0, 2.0, 3.0, 5.0], warmup=1) == pytest.approx((30 + 40) / 3)
    assert hf_baseline.per_second([10, 20], [1.0, 2.0], warmup=1) is None


@pytest.mark.slow
def test_the_script_trains_a_tiny_chat_recipe_on_the_cpu(tmp_path):
    out = tmp_path / "hf.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "scripts.hf_baseline",
            str(chat_recipe(tmp_path)),
            "--steps",
            "4",
            "--warmup",
            "1",
            "--out",
            str(out),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**without_rank_variables(os.environ), "PYTHONPATH": str(ROOT)},  # `scripts` from another folder
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["steps"] == 4
    assert 0 < result["target_tokens_per_s"] < 0.5 * result["tokens_per_s"]  # responses only
