"""Preference pairs laid out packed (varlen attention on the GPU): the same sequences as the pairs layout, in rows
of twice seq_len numbered by `sequence_ids`, and the same losses, metrics and gradients through PreferenceLM."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from memtrain.data.rows.dataset import build_datasets
from memtrain.data.rows.loader import BatchLoader, collate, micro_batches_of, step_positions
from memtrain.model.preference import PreferenceLM, preference_metrics
from memtrain.model.preference_loss import PreferenceSettings
from memtrain.model.varlen import ATTN_NAME
from memtrain.recipe.schema import Precision
from tests.data.rows.test_pairs import answer, pair_records, pairs_data, user
from tests.model.families import tiny_config

IGNORE = -100


@pytest.fixture
def pairs(chat_tokenizer, make_data, write_jsonl):
    """Twelve pairs of 20-30 tokens a sequence, seq_len 64: a row of 128 holds two pairs or more."""
    train, _ = build_datasets(pairs_data(make_data, write_jsonl, pair_records()), chat_tokenizer, seed=0)
    return train.with_reference(np.arange(24, dtype=np.float32).reshape(12, 2) - 40.0)


def test_packed_pairs_hold_the_pairs_layouts_sequences_numbered_as_its_rows(pairs):
    step = list(range(12))
    micro = micro_batches_of(pairs, step, micro_batch=2, pack_steps=True)
    assert sorted(sum(micro, [])) == step and len(micro) < 6  # fewer micro-batches than 2 pairs each
    for indices in micro:
        packed, rows = collate(pairs, indices, pack=True), collate(pairs, indices)
        assert set(packed) == {"input_ids", "labels", "position_ids", "sequence_ids", "ref_logps"}
        assert packed["input_ids"].shape[0] <= 2 and packed["input_ids"].shape[1] == 2 * pairs.seq_len
        assert torch.equal(packed["ref_logps"], rows["ref_logps"])  # chosen of every pair, then rejected
        for k in range(2 * len(indices)):  # sequence k is the pairs layout's row k
            where = packed["sequence_ids"] == k
            length = int(rows["attention_mask"][k].sum())
            assert int(where.sum()) == length
            assert torch.equal(packed["input_ids"][where], rows["input_ids"][k, :length])
            assert torch.equal(packed["labels"][where], rows["labels"][k, :length])
            assert packed["position_ids"][where].tolist() == list(range(length))
        padding = packed["sequence_ids"] == -1
        assert (packed["labels"][padding] == IGNORE).all() and (packed["position_ids"][padding] > 0).all()
    # the step computes its rows of 128, padding included, as the loop and `plan --data` count them
    assert step_positions(pairs, step, 12, 2, trim=True, pack_steps=True) == sum(
        collate(pairs, m, pack=True)["input_ids"].numel() for m in micro
    )
    with BatchLoader(pairs, torch.device("cpu"), pack_steps=True) as loader:
        assert loader.split(step, 2) == micro
        assert torch.equal(loader.get(micro[0])["sequence_ids"], collate(pairs, micro[0], pack=True)["sequence_ids"])


def test_pairs_split_into_as_many_micro_batches_as_another_rank_runs(pairs):
    """A rank whose pairs fill fewer rows than another rank's micro-batches: its fullest rows split in two, each
    micro-batch one row holding whole pairs (each sequence numbered), every pair once."""
    share = list(range(6))
    rows = len(micro_batches_of(pairs, share, micro_batch=1, pack_steps=True))
    assert rows < 6  # several pairs to a row
    micro = micro_batches_of(pairs, share, micro_batch=1, pack_steps=True, count=6)
    assert len(micro) == 6 and sorted(sum(micro, [])) == share
    for indices in micro:
        packed = collate(pairs, indices, pack=True)
        assert packed["input_ids"].shape == (1, 2 * pairs.seq_len)
        assert sorted(set(packed["sequence_ids"].flatten().tolist()) - {-1}) == list(range(2 * len(indices)))


def _model(vocab: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_config("llama", vocab_size=vocab, attn_implementation=ATTN_NAME)
    return AutoModelForCausalLM.from_config(config)  # on the CPU the varlen path attends sample by sample


def _loss_metrics_grads(module: PreferenceLM, batches: list[dict]) -> tuple[float, dict, dict]:
    module.zero_grad(set_to_none=True)
    total = 0.0
    for batch in batches:
        loss_sum, pairs = module(**batch)
        loss_sum.backward()
        total += float(loss_sum.detach())
    metrics = preference_metrics(module.take_metric_sums())
    return total, metrics, {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "settings, reference",
    [
        (PreferenceSettings(objective="dpo"), "precomputed"),
        (PreferenceSettings(objective="dpo", loss_type="ipo"), "precomputed"),
        (PreferenceSettings(objective="dpo", sft_weight=0.5), "precomputed"),
        (PreferenceSettings(objective="simpo"), "none"),
        (PreferenceSettings(objective="orpo"), "none"),
    ],
    ids=["dpo", "ipo", "rpo", "simpo", "orpo"],
)
def test_packed_pairs_give_the_pairs_layouts_losses_metrics_and_gradients(pairs, chat_tokenizer, settings, reference):
    """fp32 on the CPU: ORPO's every-real-token SFT term included, whose targets must not reach across sequences."""
    module = PreferenceLM(_model(len(chat_tokenizer)), Precision(compute="fp32"), settings, reference)
    micro = micro_batches_of(pairs, list(range(12)), micro_batch=2, pack_steps=True)
    packed = _loss_metrics_grads(module, [collate(pairs, m, pack=True) for m in micro])
    rows = _loss_metrics_grads(module, [collate(pairs, m, trim=True) for m in micro])
    assert packed[0] == pytest.approx(rows[0], rel=1e-5)
    assert packed[1] == pytest.approx(rows[1], rel=1e-5, abs=1e-6)
    assert packed[2].keys() == rows[2].keys()
    for name, grad in packed[2].items():
        # fp32 sums in another order: the error of an element near zero scales with the largest element it was summed
        # beside (IPO's squared loss gives gradients of ~5, where an element's 4e-6 is within rounding)
        scale = max(1.0, rows[2][name].abs().max().item())
        torch.testing.assert_close(grad, rows[2][name], rtol=1e-4, atol=1e-6 * scale, msg=name)


def test_kto_records_are_not_packed(chat_tokenizer, make_data, write_jsonl):
    records = [{"prompt": user(f"Is {i} even?"), "completion": answer("yes"), "label": i % 2 == 0} for i in range(8)]
    path = write_jsonl("kto.jsonl", records)
    data = make_data(train=[{"path": path, "type": "kto"}], template="chatml", seq_len=64)
    train, _ = build_datasets(data, chat_tokenizer, seed=0)
    with pytest.raises(ValueError, match="not laid out packed"):
        collate(train, [0, 1], pack=True)
