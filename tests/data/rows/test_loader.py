"""The resumable sample order and the prefetching batch loader."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memtrain.data.rows.dataset import document_windows, packed_windows
from memtrain.data.rows.loader import BatchLoader, SampleOrder, collate


def concatenated_epochs(order: SampleOrder, n_epochs: int) -> list[int]:
    return [int(i) for epoch in range(n_epochs) for i in order.permutation(epoch)]


def test_each_epoch_is_a_permutation_and_epochs_differ():
    order = SampleOrder(50, seed=3)
    epochs = [order.indices(epoch * 50, 50) for epoch in range(4)]
    for indices in epochs:
        assert sorted(indices) == list(range(50))
    assert len({tuple(indices) for indices in epochs}) == 4
    assert epochs[0] != list(range(50))


def test_order_is_deterministic_across_instances_and_depends_on_seed():
    assert SampleOrder(97, seed=11).indices(0, 300) == SampleOrder(97, seed=11).indices(0, 300)
    assert SampleOrder(97, seed=11).indices(0, 97) != SampleOrder(97, seed=12).indices(0, 97)


@settings(max_examples=60, deadline=None)
@given(
    n_samples=st.integers(1, 40), seed=st.integers(0, 2**32 - 1), start=st.integers(0, 150), count=st.integers(0, 120)
)
def test_indices_equal_slicing_the_concatenated_epochs(n_samples, seed, start, count):
    order = SampleOrder(n_samples, seed)
    n_epochs = (start + count) // n_samples + 1
    assert order.indices(start, count) == concatenated_epochs(order, n_epochs)[start : start + count]


def test_crossing_an_epoch_boundary_and_resuming():
    order = SampleOrder(10, seed=5)
    span = order.indices(7, 6)  # 3 from epoch 0, 3 from epoch 1
    assert span == order.permutation(0)[7:].tolist() + order.permutation(1)[:3].tolist()
    assert [order.epoch_of(c) for c in (0, 9, 10, 19, 20)] == [0, 0, 1, 1, 2]
    # Consumed in micro-batches of 4 or resumed from sample 12 by a new process: the same stream.
    steps = [order.indices(c, 4) for c in range(0, 24, 4)]
    resumed = SampleOrder(10, seed=5).indices(12, 12)
    assert sum(steps, [])[12:] == resumed


def test_bad_arguments():
    with pytest.raises(ValueError):
        SampleOrder(0, seed=1)
    with pytest.raises(ValueError):
        SampleOrder(3, seed=1).indices(-1, 2)


@pytest.fixture
def windows():
    return packed_windows(np.arange(2000, dtype=np.uint16), seq_len=16, pad_id=1)


class ThreadRecording(torch.utils.data.Dataset):
    """A dataset that notes which thread loaded each item."""

    def __init__(self, inner):
        self.inner, self.threads = inner, []

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        self.threads.append(threading.current_thread().name)
        return self.inner[index]


def test_collate_stacks_items(windows):
    batch = collate(windows, [3, 0, 3])
    assert batch["input_ids"].shape == (3, 16) and batch["input_ids"].dtype == torch.long
    assert torch.equal(batch["input_ids"][0], windows[3]["input_ids"])
    assert torch.equal(batch["labels"][1], windows[0]["labels"])


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_loader_matches_direct_collation(windows, prefetch):
    order = SampleOrder(len(windows), seed=0)
    recording = ThreadRecording(windows)
    with BatchLoader(recording, torch.device("cpu"), prefetch=prefetch) as loader:
        cursor, micro_batch = 0, 4
        loader.prefetch(order.indices(cursor, micro_batch))
        for _ in range(30):  # past the end of the first epoch (125 windows)
            indices = order.indices(cursor, micro_batch)
            cursor += micro_batch
            loader.prefetch(order.indices(cursor, micro_batch))
            batch = loader.get(indices)
            expected = collate(windows, indices)
            assert batch.keys() == expected.keys()
            for key in expected:
                assert batch[key].device.type == "cpu" and torch.equal(batch[key], expected[key])
        assert len(loader._pending) <= prefetch
    loaded_in_get = recording.threads.count(threading.current_thread().name)
    assert loaded_in_get == (30 * 4 if prefetch == 0 else 0)  # else every batch was the prefetched one


def test_loader_ignores_stale_prefetches(windows):
    loader = BatchLoader(windows, torch.device("cpu"), prefetch=2)
    for start in range(0, 40, 4):  # the micro-batch changed: none of these are asked for
        loader.prefetch(list(range(start, start + 4)))
    assert list(loader._pending) == [tuple(range(s, s + 4)) for s in (28, 32, 36)]  # prefetch + 1, newest kept
    batch = loader.get([5, 6])
    assert torch.equal(batch["input_ids"], collate(windows, [5, 6])["input_ids"])
    loader.close()


def test_taking_a_batch_drops_the_ones_queued_before_it(windows):
    with BatchLoader(windows, torch.device("cpu"), prefetch=3) as loader:
        for start in (0, 4, 8):
            loader.prefetch(list(range(start, start + 4)))
        loader.get([4, 5, 6, 7])  # the batch at 0 was skipped (a rollback, a resized micro-batch)
        assert list(loader._pending) == [(8, 9, 10, 11)]


def test_loader_pads_unpacked_documents():
    tokens = np.array([5, 0, 6, 7, 0], dtype=np.uint16)
    docs = document_windows(tokens, np.array([2, 5]), seq_len=4, pad_id=1)
    with BatchLoader(docs, torch.device("cpu")) as loader:
        loader.prefetch([1, 0])
        batch = loader.get([1, 0])
    assert batch["input_ids"].tolist() == [[6, 7, 0, 1], [5, 0, 1, 1]]
    assert batch["labels"].tolist() == [[6, 7, 0, -100], [5, 0, -100, -100]]


def test_errors_in_the_background_reach_the_caller(windows):
    with BatchLoader(windows, torch.device("cpu")) as loader:
        loader.prefetch([len(windows) + 5])
        with pytest.raises(IndexError):
            loader.get([len(windows) + 5])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_batches_come_from_pinned_memory(windows):
    with BatchLoader(windows, torch.device("cuda"), prefetch=2) as loader:
        loader.prefetch([0, 1])
        host = loader._pending[(0, 1)].result()
        assert all(tensor.is_pinned() for tensor in host.values())
        batch = loader.get([0, 1])
    assert batch["input_ids"].is_cuda
    assert torch.equal(batch["input_ids"].cpu(), collate(windows, [0, 1])["input_ids"])
