"""Per-sample target counts are summed a chunk at a time over the memory-mapped target flags: the same sums as a
cumulative sum over the whole array, for any spans (empty, repeated, overlapping, at either end), at any chunk size."""

from __future__ import annotations

import numpy as np
import pytest

from memtrain.data.rows import row_set as rows
from memtrain.data.rows.row_set import SampleViews, span_sums


@pytest.mark.parametrize("chunk", [1, 3, 7, 1 << 22])
def test_span_sums_are_those_of_a_whole_cumulative_sum(chunk, monkeypatch):
    monkeypatch.setattr(rows, "PREFIX_CHUNK", chunk)
    rng = np.random.default_rng(chunk)
    for _ in range(300):
        n = int(rng.integers(1, 50))
        values = rng.integers(0, 2, n).astype(np.uint8)
        begin = rng.integers(0, n + 1, int(rng.integers(0, 12)))
        end = np.minimum(begin + rng.integers(0, n + 1, len(begin)), n)
        cumulative = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])
        assert span_sums(values, begin, end).tolist() == (cumulative[end] - cumulative[begin]).tolist()


def test_target_counts_leave_out_each_samples_first_token_across_sources(monkeypatch):
    monkeypatch.setattr(rows, "PREFIX_CHUNK", 4)
    targets = (np.array([1, 1, 0, 1, 1, 1, 0, 1, 1, 1], dtype=np.uint8), np.array([0, 1, 1], dtype=np.uint8))
    tokens = tuple(np.zeros(len(t), dtype=np.uint16) for t in targets)
    views = SampleViews(
        tokens,
        targets,
        source=np.array([0, 1, 0, 0, 0, 1]),
        start=np.array([0, 0, 3, 3, 10, 3]),
        length=np.array([3, 3, 7, 2, 0, 0]),
    )
    # [1,1,0] -> 1; [0,1,1] -> 2; [1,1,1,0,1,1,1] -> 5; [1,1] -> 1; empty at the end -> 0; empty -> 0
    assert views.target_counts().tolist() == [1, 2, 5, 1, 0, 0]
