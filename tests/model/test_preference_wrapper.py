"""PreferenceLM on hand-built batches in the pairs layout: LoRA's disabled adapters are the base model, DPO's first
loss with the reference equal to the policy is ln 2, and the (loss sum, pairs) contract holds across micro-batches."""

from __future__ import annotations

import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

from memtrain.labels import IGNORE_INDEX
from memtrain.model.preference import PreferenceLM, preference_metrics
from memtrain.model.preference_loss import PreferenceSettings
from memtrain.recipe.schema import Precision
from tests.model.families import tiny_config

FP32 = Precision(compute="fp32")
CHUNKED = Precision(
    compute="fp32", chunked_loss=True, loss_chunk_tokens=16
)  # a batch of 6-8 rows x 11 shifted tokens: several chunks


def _pairs(n: int, width: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    """n pairs: a shared prompt of 4-5 tokens, completions of different lengths, right-padded (the pairs layout)."""
    g = torch.Generator().manual_seed(seed)
    rows = 2 * n
    input_ids = torch.zeros(rows, width, dtype=torch.long)
    labels = torch.full((rows, width), IGNORE_INDEX)
    attention = torch.zeros(rows, width, dtype=torch.long)
    for i in range(n):
        prompt = torch.randint(5, 4000, (4 + i % 2,), generator=g)
        for row, length in ((i, 3 + i % 3), (n + i, 2 + (i + 1) % 4)):
            completion = torch.randint(5, 4000, (length,), generator=g)
            seq = torch.cat([prompt, completion])
            input_ids[row, : len(seq)] = seq
            attention[row, : len(seq)] = 1
            labels[row, len(prompt) : len(seq)] = completion
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention}


@pytest.fixture
def base_dir(tmp_path):
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config("llama")).save_pretrained(tmp_path / "base")
    return tmp_path / "base"


def _lora(base_dir, *, trained: bool):
    model = get_peft_model(
        LlamaForCausalLM.from_pretrained(base_dir), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    if trained:  # adapters that change the output, as after some steps
        torch.manual_seed(3)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.data.normal_(0, 0.5)
    return model


def test_adapters_off_reference_equals_a_separately_loaded_base(base_dir):
    batch = _pairs(3)
    settings = PreferenceSettings(objective="dpo")
    policy = PreferenceLM(_lora(base_dir, trained=True), CHUNKED, settings, "adapters_off")
    ref = policy.reference_logps(**batch)
    base = PreferenceLM(LlamaForCausalLM.from_pretrained(base_dir), CHUNKED, settings, "none")
    expected = base.reference_logps(**batch)
    assert torch.allclose(ref, expected, atol=1e-6, rtol=0)
    with torch.no_grad():
        adapted = policy.sequence_logps(batch["input_ids"], batch["labels"], batch["attention_mask"])
    assert (adapted - expected).abs().max() > 1e-2  # the adapters do matter outside the reference
    # and the adapters are back on after the reference pass
    loss_sum, pairs = policy(**batch)
    assert (loss_sum / pairs).item() != pytest.approx(math.log(2), abs=1e-4)


@pytest.mark.parametrize("loss_type", ["sigmoid"])
def test_first_dpo_loss_is_ln2(base_dir, loss_type):
    """A fresh LoRA (lora_B = 0) is its own reference: every pair's log ratio is 0, so -log σ(0) = ln 2."""
    batch = _pairs(4)
    model = _lora(base_dir, trained=False)
    policy = PreferenceLM(model, CHUNKED, PreferenceSettings(objective="dpo", loss_type=loss_type), "adapters_off")
    loss_sum, pairs = policy(**batch)
    assert int(pairs) == 4
    assert abs((loss_sum / pairs).item() - math.log(2)) < 1e-6
    (loss_sum / pairs).backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]
    assert grads and all(g is not None for g in grads) and max(g.abs().max().item() for g in grads) > 0
    metrics = preference_metrics(policy.take_metric_sums())
    assert metrics["reward_margin"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["reward_accuracy"] == 0.0  # a tie is not a win (TRL: chosen > rejected)
    assert policy.take_metric_sums() is None


def test_micro_batches_sum_to_the_whole_batch(base_dir):
    """Two micro-batches of 2 pairs give the same loss sum and metric sums as one micro-batch of 4 pairs."""
    batch = _pairs(4)
    policy = PreferenceLM(_lora(base_dir, trained=True), FP32, PreferenceSettings(objective="dpo"), "adapters_off")
    whole, pairs = policy(**batch)
    whole_metrics = policy.take_metric_sums()
    halves = []
    for part in ([0, 1], [2, 3]):
        rows = part + [4 + i for i in part]
        halves.append(policy(**{k: v[rows] for k, v in batch.items()}))
    assert torch.allclose(halves[0][0] + halves[1][0], whole, atol=1e-6)
    assert int(halves[0][1] + halves[1][1]) == int(pairs) == 4
    assert torch.allclose(policy.take_metric_sums(), whole_metrics, atol=1e-5)


def test_precomputed_reference_equals_on_the_fly(base_dir):
    """ref_logps in the batch (the precomputed pass) give the loss adapters_off gives."""
    batch = _pairs(3)
    settings = PreferenceSettings(objective="dpo", beta=0.5)
    policy = PreferenceLM(_lora(base_dir, trained=True), FP32, settings, "adapters_off")
    on_the_fly = policy(**batch)[0]
    ref = PreferenceLM(LlamaForCausalLM.from_pretrained(base_dir), FP32, settings, "precomputed").reference_logps(
        **batch
    )
    precomputed = PreferenceLM(policy.model, FP32, settings, "precomputed")(**batch, ref_logps=ref)[0]
    assert torch.allclose(on_the_fly, precomputed, atol=1e-6)
