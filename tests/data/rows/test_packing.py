"""Packed rows train exactly like their samples one by one, and attention never crosses a sample boundary.

Real parts throughout: rows from the bundled chat data, a tiny LlamaForCausalLM built from a config, and
memtrain's TrainableLM (the module DeepSpeed runs), in fp32 on the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memtrain.data.rows.dataset import build_datasets
from memtrain.data.rows.packing import pack_rows
from memtrain.model import wrapper
from memtrain.model.varlen import ATTN_NAME as VARLEN
from memtrain.model.wrapper import TrainableLM
from memtrain.recipe.schema import Precision

IGNORE = -100


def tiny_model(vocab_size: int, attn: str) -> TrainableLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=vocab_size,
        max_position_embeddings=256,
        attn_implementation=attn,
    )
    model = LlamaForCausalLM(config).float()
    # chunks smaller than a micro-batch so the chunked loss is the path under test too
    return TrainableLM(model, Precision(compute="fp32", loss_chunk_tokens=64))


@pytest.fixture(scope="module")
def packed_rows(chat_tokenizer, tmp_path_factory):
    from memtrain.recipe.schema import Data

    spec = {"path": "builtin:chat/validation", "type": "chat"}
    data = Data(
        train=[spec], validation=[spec], seq_len=96, packing=True, cache_dir=str(tmp_path_factory.mktemp("cache"))
    )
    train, _ = build_datasets(data, chat_tokenizer, seed=3)
    return train


def loss_and_grads(model: TrainableLM, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int, dict]:
    model.zero_grad(set_to_none=True)
    loss_sum, n_targets = model(**batch)
    loss_sum.backward()
    return loss_sum.detach(), int(n_targets), {n: p.grad.clone() for n, p in model.named_parameters()}


def one_by_one(model: TrainableLM, rows, indices: list[int]) -> tuple[torch.Tensor, int, dict]:
    """Every sample of the rows alone, unpadded, with default positions: the reference."""
    total, count, grads = torch.zeros(()), 0, None
    for index in indices:
        item = rows[index]
        at = 0
        for sample in rows.row(index):
            length = int(rows.samples.length[sample])
            input_ids = item["input_ids"][at : at + length].unsqueeze(0)
            labels = item["labels"][at : at + length].unsqueeze(0)
            at += length
            loss, n, g = loss_and_grads(model, {"input_ids": input_ids, "labels": labels})
            total, count = total + loss, count + n
            grads = g if grads is None else {k: grads[k] + g[k] for k in grads}
    return total, count, grads


# VARLEN on the CPU: the wrapper's sample bounds and the attention function's flattening, each sample attended
# alone (memtrain.model.varlen.attend_by_sample); the CUDA kernel itself is tested in tests/model/test_varlen.py
@pytest.mark.parametrize("attn", ["sdpa", "eager", VARLEN])
def test_packed_micro_batch_equals_its_samples_one_by_one(packed_rows, chat_tokenizer, attn):
    indices = [i for i in range(len(packed_rows)) if len(packed_rows.row(i)) >= 3][:3]
    assert len(indices) == 3
    model = tiny_model(len(chat_tokenizer), attn)
    batch = {key: torch.stack([packed_rows[i][key] for i in indices]) for key in packed_rows[0]}
    packed_loss, packed_n, packed_grads = loss_and_grads(model, batch)
    single_loss, single_n, single_grads = one_by_one(model, packed_rows, indices)
    assert packed_n == single_n == packed_rows.targets(indices)
    torch.testing.assert_close(packed_loss, single_loss, rtol=1e-5, atol=1e-5)
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, single_grads[name], rtol=1e-5, atol=1e-5, msg=name)


def test_flattened_rows_for_flash_attention_give_the_same_loss(packed_rows, chat_tokenizer, monkeypatch):
    """Flash attention sees packing only in a batch of one; the flattening the wrapper does must not change the math.
    (Checked with sdpa, which reads the same restarts, since flash attention needs a GPU.)"""
    indices = [0, 1, 2]
    model = tiny_model(len(chat_tokenizer), "sdpa")
    batch = {key: torch.stack([packed_rows[i][key] for i in indices]) for key in packed_rows[0]}
    reference = loss_and_grads(model, batch)
    monkeypatch.setitem(wrapper.PACKED_ATTENTION, "sdpa", "flatten")
    flattened = loss_and_grads(model, batch)
    assert flattened[1] == reference[1]
    torch.testing.assert_close(flattened[0], reference[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager", VARLEN])
def test_attention_does_not_cross_a_sample_boundary(packed_rows, chat_tokenizer, attn):
    index = next(i for i in range(len(packed_rows)) if len(packed_rows.row(i)) >= 2)
    item = packed_rows[index]
    first = int(packed_rows.samples.length[packed_rows.row(index)[0]])
    model = tiny_model(len(chat_tokenizer), attn)
    decoder = model.model.model

    def later_samples_hidden(input_ids, position_ids):
        with torch.no_grad():
            hidden = decoder(input_ids=input_ids.unsqueeze(0), position_ids=position_ids, use_cache=False)
        return hidden.last_hidden_state[0, first:]

    changed = item["input_ids"].clone()
    changed[:first] = torch.randint(2, 4096, (first,), generator=torch.Generator().manual_seed(1))
    positions = item["position_ids"].unsqueeze(0)
    torch.testing.assert_close(
        later_samples_hidden(changed, positions), later_samples_hidden(item["input_ids"], positions), rtol=0, atol=1e-6
    )
    # the same change does reach the later samples without the restarting positions: the check has teeth
    assert not torch.allclose(later_samples_hidden(changed, None), later_samples_hidden(item["input_ids"], None))

    # and through the training module: the later samples' loss ignores the first sample's tokens
    labels = item["labels"].clone()
    labels[:first] = IGNORE
    losses = [
        model(input_ids=ids.unsqueeze(0), labels=labels.unsqueeze(0), position_ids=positions)[0].item()
        for ids in (item["input_ids"], changed)
    ]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_rows_restart_positions_and_pad_after_the_samples(packed_rows, chat_tokenizer):
    for index in range(len(packed_rows)):
        item = packed_rows[index]
        at = 0
        for sample in packed_rows.row(index):
            length = int(packed_rows.samples.length[sample])
            assert item["position_ids"][at : at + length].tolist() == list(range(length))
            assert item["labels"][at] == IGNORE
            at += length
        assert (item["input_ids"][at:] == chat_tokenizer.pad_token_id).all() and (item["labels"][at:] == IGNORE).all()
        if at < packed_rows.seq_len:  # padding continues the last sample's positions: no extra restart
            assert int(item["position_ids"][at]) == int(item["position_ids"][at - 1]) + 1


def test_pack_rows_fits_every_sample_once_and_tightly():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 65, size=500)
    rows = pack_rows(lengths, 64)
    assert sorted(i for row in rows for i in row) == list(range(500))
    assert all(sum(lengths[i] for i in row) <= 64 for row in rows)
    # a row is opened only for a sample that fits no open row, so at most one row is half full or less
    assert sum(1 for row in rows if sum(lengths[i] for i in row) <= 32) <= 1
    assert rows == pack_rows(lengths, 64)  # a function of the lengths alone
    with pytest.raises(ValueError):
        pack_rows(np.array([65]), 64)


def test_unpacked_rows_hold_one_sample_each(chat_tokenizer, make_data):
    spec = {"path": "builtin:chat/validation", "type": "chat"}
    train, _ = build_datasets(
        make_data(train=[spec], validation=[spec], seq_len=96, packing=False), chat_tokenizer, seed=0
    )
    assert len(train) == train.stats.samples == 300
    assert all(len(train.row(i)) == 1 for i in range(len(train)))
    assert 0 < train.stats.padding_share < 1


def test_packing_leaves_little_padding(packed_rows):
    assert packed_rows.stats.padding_share < 0.10  # one sample each pads about 65 % of the rows (seq_len 96)
    assert packed_rows.stats.samples == sum(len(packed_rows.row(i)) for i in range(len(packed_rows)))
