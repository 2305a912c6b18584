"""Text documents cut into pieces of seq_len tokens: how every text path turns a document into rows.

One owner for the rule, read by the text stream (dataset.document_windows), a text dataset of a list
(mixture._prepare) and the count of the densest row at other lengths (loader.document_pieces): whole pieces of
seq_len tokens, then the document's rest; nothing dropped here (callers leave out a one-token piece, which has no
target)."""

from __future__ import annotations

import numpy as np


def cut_documents(starts, lengths, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the document each piece comes from, the piece's start, its length), piece after piece in document order."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    pieces = -(-lengths // seq_len)
    offsets = np.arange(int(pieces.sum()), dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    owners = np.repeat(np.arange(len(lengths), dtype=np.int64), pieces)
    return owners, starts[owners] + offsets * seq_len, np.minimum(lengths[owners] - offsets * seq_len, seq_len)
