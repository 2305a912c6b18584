"""Cutting a long document into pieces that tokenise to the same tokens as the whole.

A text file is one document, and a fast tokenizer holds about 160 bytes per character of one call while it works
(alignments of the normalized string, offsets, token strings): a 100 MB .txt took 16.6 GB of memory in one call,
so a few hundred MB ran a 32-64 GB machine out of memory. A document longer than PIECE_CHARS is cut about every
PIECE_CHARS characters, after a letter and before a space and a letter ("a| b") or before punctuation ("文|。"):
there byte-level BPE (GPT-2, Llama 3, Qwen) starts a new pre-token, and Metaspace (SentencePiece conversions) does
before a space, so the pieces' tokens end to end are the whole's. Each cut is checked with the tokenizer itself:
the CHECK_CHARS on either side must tokenise the same together as apart, else the next candidate is tried. Where
none of CANDIDATES passes, the rest of the document goes in one call, as before: a normalizer that prepends "▁" to
every call (older Llama 2 conversions), and Metaspace on text without spaces (Chinese, Japanese; measured: a
36 MB Chinese file took 4.2 GB). Memory still grows with a file, by about 20 bytes per byte (measured: 200 MB
of text, 4.1 GB): the text, its pieces and their ids are all held until the entry is written.
Pieces also let the tokenizer's threads share one long document.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import numpy as np
from transformers import PreTrainedTokenizerBase

from memtrain.data.tokens.progress import report

PIECE_CHARS = 1 << 20
# Characters handed to the tokenizer per call: large enough for its batch parallelism, small enough for memory.
BATCH_CHARS = 8 << 20
BATCH_DOCUMENTS = 4096
CHECK_CHARS = 200
CANDIDATES = 32  # cuts tried near each place before the rest goes in one call
_CUT = re.compile(r"(?<=[^\W\d_])(?= [^\W\d_]|[^\w\s])")  # after a letter: before " letter" or punctuation


def encode_documents(
    documents: Iterable[str], tokenizer: PreTrainedTokenizerBase, what: str = "tokenising"
) -> Iterator[np.ndarray]:
    """Each document's token ids (uint32, no eos), in order: documents go to the tokenizer in batches of about
    BATCH_CHARS characters, a long one in pieces. Reports the pieces done under `what` (data/tokens/progress.py)."""
    encoded = 0
    batch: list[str] = []
    last_piece: list[bool] = []  # beside batch: whether the piece ends its document
    done: list[np.ndarray] = []  # the pieces of the document under way
    chars = 0
    for document in documents:
        parts = pieces(document, tokenizer)
        for i, part in enumerate(parts):
            batch.append(part)
            last_piece.append(i + 1 == len(parts))
            chars += len(part)
            if chars >= BATCH_CHARS or len(batch) >= BATCH_DOCUMENTS:
                yield from _encode(batch, last_piece, done, tokenizer)
                encoded += len(batch)
                report(what, encoded, 0)  # how many there are is known only at the end
                batch, last_piece, chars = [], [], 0
    if batch:
        yield from _encode(batch, last_piece, done, tokenizer)


def _encode(
    batch: list[str], last_piece: list[bool], done: list[np.ndarray], tokenizer: PreTrainedTokenizerBase
) -> Iterator[np.ndarray]:
    for ids, last in zip(_ids(tokenizer, batch), last_piece):
        done.append(np.asarray(ids, dtype=np.uint32))
        if last:
            yield done[0] if len(done) == 1 else np.concatenate(done)
            done.clear()


def pieces(document: str, tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """`document` cut where its tokens do not change (see the module doc); [document] when it is short."""
    out, start = [], 0
    while len(document) - start > PIECE_CHARS:
        cut = _stable_cut(document, start + PIECE_CHARS, tokenizer)
        if cut is None:
            break
        out.append(document[start:cut])
        start = cut
    out.append(document[start:])
    return out


def _stable_cut(document: str, near: int, tokenizer: PreTrainedTokenizerBase) -> int | None:
    for tried, match in enumerate(_CUT.finditer(document, near)):
        if tried == CANDIDATES:
            return None
        cut = match.start()
        left, right = document[max(0, cut - CHECK_CHARS) : cut], document[cut : cut + CHECK_CHARS]
        if _ids(tokenizer, left + right) == _ids(tokenizer, left) + _ids(tokenizer, right):
            return cut
    return None


def _ids(tokenizer: PreTrainedTokenizerBase, text: str | list[str]) -> list:
    """The token ids of `text` (of each text of a list), as a document's: no added special tokens, and text that
    spells "<|endoftext|>" does not turn into a real separator (split_special_tokens)."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True, verbose=False)["input_ids"]
