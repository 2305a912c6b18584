"""A path in data.train keeps today's text behaviour byte for byte: the same windows and the same cache entry
(but for unpacked text, which no longer drops what follows a document's first window).

The digests below were computed with the code at the base of this branch (commit 455c843, before list
datasets existed) over every window's input_ids and labels of the bundled Shakespeare, seq_len 64.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from pydantic import ValidationError

from memtrain.data.rows.dataset import build_datasets
from memtrain.data.tokens.cache import cache_paths
from memtrain.recipe.schema import Data

VALIDATION = "builtin:shakespeare/validation"
GOLDEN = {  # (packing, validation): (train windows, validation windows, sha256)
    (True, None): (4914, 259, "810512bafc5aef46a46458c3f377f3a4fa88a5fb18c4b8dbbbfaf4e17039d09d"),
    (True, VALIDATION): (5173, 633, "3ddda9ba4902f4f6c1eb2cec0573330f380299adbf259e8bd33c5712b4a76da3"),
    # Unpacked, a document goes on in further windows, as packed: the packed windows and the tail (cut to its
    # first window, the corpus would give 1 and 1).
    (False, VALIDATION): (5174, 634, "e2d6f662a9aea21fb9ac04349d9a3825f21a80275de57440e4cc5c801bd86515"),
}
CACHE_KEY = "7e8aa4e9b868809d5edc9f92b169eb74e927545c3db35e78cd283c2fe3bbf643"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tokens"))


@pytest.mark.parametrize("packing, validation", list(GOLDEN))
def test_text_windows_are_those_of_the_branch_base(packing, validation, text_tokenizer, cache_dir):
    data = Data(train="builtin:shakespeare", validation=validation, seq_len=64, packing=packing, cache_dir=cache_dir)
    train, held_out = build_datasets(data, text_tokenizer, seed=7)
    digest = hashlib.sha256()
    for dataset in (train, held_out):
        digest.update(str(len(dataset)).encode())
        for i in range(len(dataset)):
            item = dataset[i]
            assert set(item) == {"input_ids", "labels"}
            digest.update(item["input_ids"].numpy().tobytes())
            digest.update(item["labels"].numpy().tobytes())
    assert (len(train), len(held_out), digest.hexdigest()) == GOLDEN[(packing, validation)]


def test_an_unpacked_document_gives_the_packed_windows_and_its_tail(text_tokenizer, cache_dir):
    packed, unpacked = (
        build_datasets(
            Data(train="builtin:shakespeare", validation=VALIDATION, seq_len=64, packing=packing, cache_dir=cache_dir),
            text_tokenizer,
            seed=7,
        )[0]
        for packing in (True, False)
    )
    assert len(unpacked) == len(packed) + 1 and unpacked.n_tokens > packed.n_tokens
    assert all(np.array_equal(unpacked[i]["input_ids"], packed[i]["input_ids"]) for i in range(len(packed)))


def test_the_text_cache_key_is_unchanged(text_tokenizer, cache_dir):
    tokens, ends = cache_paths("builtin:shakespeare", "auto", "text", text_tokenizer, cache_dir)
    assert (tokens.name, ends.name) == (f"{CACHE_KEY}.tokens.npy", f"{CACHE_KEY}.doc_ends.npy")


def test_token_windows_count_the_targets_the_loss_sees(text_tokenizer, cache_dir):
    data = Data(train="builtin:shakespeare", validation=VALIDATION, seq_len=64, packing=False, cache_dir=cache_dir)
    train, _ = build_datasets(data, text_tokenizer, seed=0)
    windows = train.select(np.zeros(3, dtype=np.int64))
    assert windows.targets([0, 1, 2]) == 3 * int((windows[0]["labels"][1:] != -100).sum()) == 3 * 63


def test_a_list_validation_with_a_text_train_path_is_refused():
    with pytest.raises(ValidationError, match="both be paths"):
        Data(train="builtin:shakespeare", validation=[{"path": VALIDATION, "type": "text"}])
    with pytest.raises(ValidationError, match="both be paths"):
        Data(train=[{"path": "builtin:shakespeare", "type": "text"}], validation=VALIDATION)
