"""Length bucketing of unpacked rows (data.group_by_length): every row once per epoch, resumable, and less padding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memtrain.data.rows.dataset import build_datasets, document_windows
from memtrain.data.rows.loader import BatchLoader, SampleOrder, batch_width, collate, sample_order, token_slots
from memtrain.labels import IGNORE_INDEX
from memtrain.recipe.schema import Data

CHAT = [{"path": "builtin:chat", "type": "chat"}]
CHAT_VALIDATION = [{"path": "builtin:chat/validation", "type": "chat"}]


@settings(max_examples=60, deadline=None)
@given(
    n_samples=st.integers(1, 60),
    group=st.integers(1, 9),
    bucket_steps=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
    start=st.integers(0, 150),
    count=st.integers(0, 120),
)
def test_a_bucketed_epoch_is_a_permutation_and_indices_slice_the_epochs(
    n_samples, group, bucket_steps, seed, start, count
):
    lengths = np.random.default_rng(seed).integers(1, 100, n_samples)
    order = SampleOrder(n_samples, seed, lengths=lengths, group=group, bucket_steps=bucket_steps)
    n_epochs = (start + count) // n_samples + 1
    epochs = [order.permutation(epoch).tolist() for epoch in range(n_epochs)]
    assert all(sorted(epoch) == list(range(n_samples)) for epoch in epochs)
    # a new process (a resumed run) sees the same stream from any cursor
    resumed = SampleOrder(n_samples, seed, lengths=lengths, group=group, bucket_steps=bucket_steps)
    assert resumed.indices(start, count) == sum(epochs, [])[start : start + count]


def test_each_step_holds_rows_of_similar_length_and_steps_stay_aligned_across_epochs():
    n, group = 103, 8  # 103 rows: an epoch is not a whole number of steps
    lengths = np.random.default_rng(0).integers(1, 1000, n)
    order = SampleOrder(n, seed=4, lengths=lengths, group=group, bucket_steps=4)
    spreads, random_spreads = [], []
    plain = SampleOrder(n, seed=4)
    for step in range(3 * n // group):  # three epochs
        rows = order.indices(step * group, group)
        if order.epoch_of(step * group) == order.epoch_of(step * group + group - 1):
            # a step within one epoch and one mega-batch is sorted, longest first
            spreads.append(np.ptp(lengths[rows]))
        random_spreads.append(np.ptp(lengths[plain.indices(step * group, group)]))
    assert np.median(spreads) < 0.25 * np.median(random_spreads)
    # the groups are shuffled: the first step is not simply the longest rows
    assert order.indices(0, group) != sorted(range(n), key=lambda i: -lengths[i])[:group]
    assert order.permutation(0).tolist() != order.permutation(1).tolist()


def test_a_cut_batch_is_the_full_batch_without_its_padding_columns(chat_tokenizer, make_data):
    train, _ = build_datasets(
        make_data(train=CHAT_VALIDATION, validation=CHAT_VALIDATION, seq_len=128, packing=False, template="chatml"),
        chat_tokenizer,
        seed=0,
    )
    indices = [3, 17, 41]
    full, cut = collate(train, indices), collate(train, indices, trim=True)
    width = batch_width(train.lengths[indices], 128)
    assert width % 8 == 0 and max(train.lengths[indices]) <= width < 128
    assert cut.keys() == full.keys()
    for key in full:
        assert torch.equal(cut[key], full[key][:, :width])
    assert (full["labels"][:, width:] == IGNORE_INDEX).all()  # nothing the loss sees is cut away
    with BatchLoader(train, torch.device("cpu"), trim=True) as loader:
        assert loader.get(indices)["input_ids"].shape == (3, width)


def test_text_documents_are_cut_too():
    tokens = np.arange(100, dtype=np.uint16)
    windows = document_windows(tokens, np.array([10, 30, 100]), seq_len=64, pad_id=0)
    assert collate(windows, [0, 1], trim=True)["input_ids"].shape == (2, 24)
    assert collate(windows, [2], trim=True)["input_ids"].shape == (1, 64)


def test_group_by_length_defaults_to_on_when_rows_are_not_packed():
    assert Data(train="builtin:shakespeare", packing=False).groups_by_length
    assert not Data(train="builtin:shakespeare").groups_by_length
    assert not Data(train="builtin:shakespeare", packing=False, group_by_length=False).groups_by_length
    assert Data(train="builtin:shakespeare", group_by_length=True).groups_by_length


def test_bucketing_cuts_the_padding_of_the_shipped_chat_data(chat_tokenizer, make_data):
    """The 3000 bundled conversations, one per row at seq_len 128, global batch 16 in micro-batches of 4:
    padding 73.8 % of the computed positions as rows of seq_len, 33.2 % cut to the longest row of random
    micro-batches, 10.3 % bucketed. Every row is still seen once per epoch."""
    data = make_data(train=CHAT, validation=CHAT_VALIDATION, seq_len=128, packing=False, template="chatml")
    train, _ = build_datasets(data, chat_tokenizer, seed=0)
    global_batch, micro_batch = 16, 4
    steps = len(train) // global_batch  # one epoch less a partial step

    def padding(order: SampleOrder, trim: bool) -> float:
        slots = token_slots(order, train, global_batch, global_batch, micro_batch, trim, steps)
        return 1 - train.lengths[order.indices(0, steps * global_batch)].sum() / slots

    plain = SampleOrder(len(train), seed=0)
    bucketed = sample_order(data, train, seed=0, global_batch=global_batch)
    full, random_cut, grouped = padding(plain, False), padding(plain, True), padding(bucketed, True)
    assert full == pytest.approx(train.stats.padding_share, abs=0.01)
    assert grouped < 0.15 < 0.25 < random_cut < full
    assert grouped < random_cut / 2
    assert sorted(bucketed.indices(0, len(train))) == list(range(len(train)))
    assert sorted(bucketed.indices(len(train), len(train))) == list(range(len(train)))
