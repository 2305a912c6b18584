"""Unpacked chat rows laid out packed within each step (data/rows/loader.py, `pack_steps`): which samples go into
which micro-batch and row, what the rows hold, and that the loss and gradients are those of the rows cut to their
longest sample."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memtrain.data.rows.dataset import build_datasets
from memtrain.data.rows.loader import (
    BatchLoader,
    collate,
    densest_row_samples,
    next_fit_rows,
    packed_micro_batches,
    packed_step_micro_batches,
    sample_order,
    step_positions,
    token_slots,
)
from memtrain.labels import IGNORE_INDEX
from memtrain.model.wrapper import TrainableLM
from tests.data.rows.test_packing import tiny_model

CHAT = [{"path": "builtin:chat", "type": "chat"}]
CHAT_VALIDATION = [{"path": "builtin:chat/validation", "type": "chat"}]
SEQ_LEN = 128


@pytest.fixture
def chat_rows(chat_tokenizer, make_data):
    """The bundled conversations, one per row of 128 tokens."""
    data = make_data(train=CHAT, validation=CHAT_VALIDATION, seq_len=SEQ_LEN, packing=False, template="chatml")
    train, _ = build_datasets(data, chat_tokenizer, seed=0)
    return data, train


class Lengths:
    """A dataset stand-in with only what the splitting reads: the samples' lengths and seq_len."""

    def __init__(self, lengths, seq_len):
        self.lengths, self.seq_len = np.asarray(lengths, dtype=np.int64), seq_len


def test_a_step_is_laid_longest_first_into_rows_taken_micro_batch_at_a_time():
    data = Lengths([100, 90, 60, 60, 40, 30, 20, 128, 5], seq_len=128)
    samples = [3, 1, 8, 0, 5, 7, 2, 6, 4]  # a step's shuffled samples
    batches = packed_micro_batches(data, samples, micro_batch=2)
    assert sorted(i for batch in batches for i in batch) == sorted(samples)  # every sample once
    # longest first (ties in the step's order): 128 | 100 20 5 | 90 30 | 60 60 | 40 (best fit), two rows a
    # micro-batch, the last row alone
    assert batches == [[7, 0, 6, 8], [1, 5, 3, 2], [4]]
    for batch in batches:  # the rows read back from a micro-batch are those it was made of
        rows = next_fit_rows(data.lengths[batch], 128)
        assert len(rows) <= 2 and all(sum(data.lengths[[batch[i] for i in row]]) <= 128 for row in rows)
    assert [len(next_fit_rows(data.lengths[b], 128)) for b in batches] == [2, 2, 1]


def _rows_read_back(data, batches: list[list[int]]) -> list[list[int]]:
    """Each micro-batch's rows as collate reads them back (next_fit_rows), as sample ids."""
    return [[batch[at] for at in row] for batch in batches for row in next_fit_rows(data.lengths[batch], data.seq_len)]


def test_ranks_run_as_many_micro_batches_rows_dealt_evenly_or_split():
    """Two ranks' shares of a step: one packs into 5 rows, the other into 2. At micro-batch 2 both run 3, the first
    its rows 2, 2, 1, the second its 2 rows split into 3 (the fuller one in two, each micro-batch one row); at
    micro-batch 1 both run 5. Every sample once, every row read back as it was laid, none over the width."""
    data = Lengths([128, 120, 110, 100, 90, 60, 50, 40, 30, 20], seq_len=128)
    busy, light = [0, 1, 2, 3, 4], [5, 6, 7, 8, 9]  # rows: each of the first alone; 60 50 | 40 30 20
    assert packed_step_micro_batches(data, busy + light, per_rank_batch=5, micro_batch=2) == 3
    assert packed_step_micro_batches(data, busy + light, per_rank_batch=5, micro_batch=1) == 5
    for micro_batch, count in ((2, 3), (1, 5)):
        for share in (busy, light):
            batches = packed_micro_batches(data, share, micro_batch, count=count)
            assert len(batches) == count and sorted(i for b in batches for i in b) == share
            rows = _rows_read_back(data, batches)
            assert all(data.lengths[row].sum() <= 128 for row in rows)
            assert all(len(next_fit_rows(data.lengths[b], 128)) <= micro_batch for b in batches)
    assert [len(b) for b in packed_micro_batches(data, busy, 2, count=3)] == [2, 2, 1]
    light_rows = packed_micro_batches(data, light, 1)
    assert len(light_rows) == 2
    split = packed_micro_batches(data, light, 1, count=5)  # 2 rows of 2 and 3 samples become 5 of one
    assert sorted(map(len, split)) == [1, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="cannot make 6 micro-batches"):
        packed_micro_batches(data, light, 1, count=6)  # more micro-batches than samples
    with pytest.raises(ValueError, match="cannot make 2 micro-batches"):
        packed_micro_batches(data, busy, 2, count=2)  # 5 rows do not go into 2 of at most 2


def test_the_positions_of_a_step_on_two_ranks_count_the_rows_each_runs():
    """Padding computed: the busy rank's 5 rows, the light rank's 2 split into 3 at micro-batch 2 (and into 5 at 1),
    each a row of seq_len."""
    data = Lengths([128, 120, 110, 100, 90, 60, 50, 40, 30, 20], seq_len=128)
    step = list(range(10))
    assert step_positions(data, step, 5, 2, True, pack_steps=True) == (5 + 3) * 128
    assert step_positions(data, step, 5, 1, True, pack_steps=True) == (5 + 5) * 128
    assert step_positions(data, step, 10, 2, True, pack_steps=True) == 7 * 128  # one rank: its 7 rows


def test_a_packed_batch_holds_the_samples_end_to_end(chat_rows):
    _, train = chat_rows
    indices = packed_micro_batches(train, [5, 9, 14, 22, 31, 40, 41, 44], 3)[0]
    batch = collate(train, indices, pack=True)
    groups = next_fit_rows(train.lengths[indices], SEQ_LEN)
    assert {k: tuple(v.shape) for k, v in batch.items()} == {k: (len(groups), SEQ_LEN) for k in batch}
    for row, group in enumerate(groups):
        at = 0
        for member in group:
            item, length = train[indices[member]], int(train.lengths[indices[member]])
            for key in ("input_ids", "labels", "position_ids"):
                assert torch.equal(batch[key][row, at : at + length], item[key][:length])
            assert batch["position_ids"][row, at] == 0  # every sample starts its own positions
            at += length
        assert (batch["labels"][row, at:] == IGNORE_INDEX).all()  # padding is never a target
        assert (batch["position_ids"][row, at:].diff() == 1).all()  # and opens no new sample
    assert int((batch["labels"] != IGNORE_INDEX).sum()) == sum(
        int((train[i]["labels"] != IGNORE_INDEX).sum()) for i in indices
    )


def test_the_loader_splits_and_lays_out_packed_micro_batches(chat_rows):
    _, train = chat_rows
    samples = list(range(16))
    with BatchLoader(train, torch.device("cpu"), trim=True, pack_steps=True) as loader:
        batches = loader.split(samples, 2)
        assert batches == packed_micro_batches(train, samples, 2)
        assert len(batches) < 16 // 2  # short conversations: several to a row
        shapes = [tuple(loader.get(b)["input_ids"].shape) for b in batches]
        assert set(shapes[:-1]) == {(2, SEQ_LEN)} and shapes[-1] in {(1, SEQ_LEN), (2, SEQ_LEN)}


def test_packed_steps_run_fewer_micro_batches_and_price_the_rows_they_compute(chat_rows):
    """The bundled conversations are a few dozen tokens: a step of 16 packs into far fewer micro-batches of
    4 x 128 than the four of cut rows. Packed micro-batches compute whole rows, and the padding priced is theirs."""
    data, train = chat_rows
    order = sample_order(data, train, seed=0, global_batch=16, pack_steps=True)
    assert order.lengths is None  # not bucketed by length: samples of one length fill rows worst
    steps = 50
    packed = [packed_micro_batches(train, order.indices(s * 16, 16), 4) for s in range(steps)]
    assert max(len(b) for b in packed) <= 2  # 16 conversations, mostly in one micro-batch
    rows = sum(len(next_fit_rows(train.lengths[b], SEQ_LEN)) for step in packed for b in step)
    assert token_slots(order, train, 16, 16, 4, True, steps, pack_steps=True) == rows * SEQ_LEN
    tokens = train.lengths[order.indices(0, steps * 16)].sum()
    assert tokens / (rows * SEQ_LEN) > 0.75  # the rows are mostly samples
    first = order.indices(0, 16)
    assert step_positions(train, first, 16, 4, True, pack_steps=True) == SEQ_LEN * sum(
        len(next_fit_rows(train.lengths[b], SEQ_LEN)) for b in packed[0]
    )


def _step(model: TrainableLM, batches: list[dict], targets: int) -> tuple[float, dict]:
    """One step's mean token loss and gradients as the loop takes them: each micro-batch's sum over the step's
    targets."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for batch in batches:
        loss_sum, _ = model(**batch)
        (loss_sum / targets).backward()
        total += float(loss_sum.detach())
    return total / targets, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_packed_step_has_the_loss_and_gradients_of_its_cut_rows(chat_rows, chat_tokenizer):
    """fp32 on the CPU, where sdpa keeps the samples of a packed row apart with a block-diagonal mask."""
    _, train = chat_rows
    samples = list(range(24, 40))
    targets = train.targets(samples)
    model = tiny_model(len(chat_tokenizer), "sdpa")  # fp32
    cut = [collate(train, samples[i : i + 4], trim=True) for i in range(0, 16, 4)]
    packed = [collate(train, b, pack=True) for b in packed_micro_batches(train, samples, 2)]
    assert len(packed) < len(cut)
    loss_cut, grads_cut = _step(model, cut, targets)
    loss_packed, grads_packed = _step(model, packed, targets)
    assert loss_packed == pytest.approx(loss_cut, rel=1e-6)
    assert grads_packed.keys() == grads_cut.keys()
    for name, grad in grads_cut.items():
        assert torch.allclose(grads_packed[name], grad, atol=1e-6, rtol=1e-4), name


def test_the_densest_row_is_the_most_of_the_shortest_samples_that_fit_one(chat_rows):
    _, train = chat_rows
    lengths = np.sort(train.lengths)
    most = densest_row_samples(train)
    assert lengths[:most].sum() <= SEQ_LEN < lengths[: most + 1].sum()
    assert densest_row_samples(Lengths([100, 90, 60, 20, 5, 128], seq_len=128)) == 3  # 5 + 20 + 60


def test_the_densest_packed_row_is_counted_as_packed(chat_tokenizer, make_data):
    data = make_data(train=CHAT, validation=CHAT_VALIDATION, seq_len=SEQ_LEN, packing=True, template="chatml")
    train, _ = build_datasets(data, chat_tokenizer, seed=0)
    per_row = np.diff(train.row_starts)
    assert per_row.max() > 1
    assert densest_row_samples(train) == per_row.max()
