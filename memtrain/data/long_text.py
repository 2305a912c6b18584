"""Cutting a long document into pieces that tokenise to the same tokens as the whole.

A text file is one document, and a fast tokenizer holds about 160 bytes per character of one call while it works
(alignments of the normalized string, offsets, token strings): a 100 MB .txt took 16.6 GB of memory in one call,
so a few hundred MB ran a 32-64 GB machine out of memory. A document longer than PIECE_CHARS is cut, about every
PIECE_CHARS characters, at a single space between two letters ("a| b"): there byte-level BPE (GPT-2, Llama 3,
Qwen) and Metaspace (SentencePiece conversions) both start a new pre-token, so the pieces' tokens end to end are
the whole's. Each cut is checked with the tokenizer itself: the CHECK_CHARS on either side must tokenise the
same together as apart. A tokenizer for which no candidate cut passes (one whose normalizer prepends "▁" to
every call, like older Llama 2 conversions) gets the rest of the document in one call, as before.
Pieces also let the tokenizer's threads share one long document.
"""
from __future__ import annotations

import re

from transformers import PreTrainedTokenizerBase

PIECE_CHARS = 1 << 20
CHECK_CHARS = 200
CANDIDATES = 32  # cuts tried near each place before the rest goes in one call
_CUT = re.compile(r"(?<=[^\W\d_])(?= [^\W\d_]|[^\w\s])")  # after a letter: before " letter" or punctuation


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
        left, right = document[max(0, cut - CHECK_CHARS):cut], document[cut:cut + CHECK_CHARS]
        if _ids(tokenizer, left + right) == _ids(tokenizer, left) + _ids(tokenizer, right):
            return cut
    return None


def _ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True, verbose=False)["input_ids"]
