"""Packing whole samples into rows of at most seq_len tokens: a pure function of the sample lengths.

Best-fit decreasing: samples from the longest down (ties by position, so the result is a function of the
lengths alone), each into the open row it fills most tightly, a new row when none has room. It leaves
little padding (every row but the last few is nearly full) and never splits a sample, so each one keeps
its own positions and attention (see samples.py).
"""

from __future__ import annotations

from bisect import bisect_left, insort

import numpy as np


def pack_rows(lengths: np.ndarray, seq_len: int) -> list[list[int]]:
    """Sample indices per row; every sample in exactly one row, each row's lengths summing to at most `seq_len`.

    Rows come in the order they were opened (the one with the longest sample first); within a row, samples
    in the order they were placed. Raises ValueError for a sample longer than `seq_len` or shorter than 1.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and (lengths.min() < 1 or lengths.max() > seq_len):
        raise ValueError(f"sample lengths must lie in 1..{seq_len}")
    order = np.lexsort((np.arange(len(lengths)), -lengths))  # longest first, then by position
    rows: list[list[int]] = []
    # Open rows as sorted keys free * stride + row: bisect finds the tightest fit, ties to the oldest row.
    stride = len(lengths) + 1
    open_rows: list[int] = []
    smallest = int(lengths.min()) if len(lengths) else 0
    for index in order.tolist():
        length = int(lengths[index])
        slot = bisect_left(open_rows, length * stride)
        if slot == len(open_rows):
            row, free = len(rows), seq_len - length
            rows.append([index])
        else:
            key = open_rows.pop(slot)
            row, free = key % stride, key // stride - length
            rows[row].append(index)
        if free >= smallest:  # a row no remaining sample fits in is closed for good
            insort(open_rows, free * stride + row)
    return rows
