"""Token windows (packed and per document) and the train/validation split."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from memtrain.data.rows.dataset import IGNORE_INDEX, build_datasets, document_windows, packed_windows
from memtrain.data.tokens.cache import cached_tokens
from memtrain.data.tokens.tokenizer import load_tokenizer
from memtrain.errors import DataError
from memtrain.recipe.schema import Data, Model


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(Model(preset="tiny"))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tokens"))


def test_packed_windows_cover_the_stream_exactly():
    tokens = np.arange(103, dtype=np.uint16)
    windows = packed_windows(tokens, seq_len=10, pad_id=1)
    assert len(windows) == 10 and windows.n_tokens == 100
    joined = torch.cat([windows[i]["input_ids"] for i in range(len(windows))])
    assert joined.tolist() == list(range(100))  # the 3 left-over tokens are dropped
    for i in range(len(windows)):
        item = windows[i]
        assert item["input_ids"].dtype == torch.long and torch.equal(item["labels"], item["input_ids"])
    with pytest.raises(IndexError):
        windows[10]


def test_document_windows_pad_and_mask():
    """A document longer than seq_len goes on in the next window: nothing is dropped (it was cut to seq_len, so a
    .txt file trained its first seq_len tokens alone); a last piece is padded and its padding masked."""
    tokens = np.array([5, 6, 0] + list(range(10, 19)) + [0] + [7, 0], dtype=np.uint16)  # docs of 3, 10, 2 tokens
    windows = document_windows(tokens, doc_ends=np.array([3, 13, 15]), seq_len=8, pad_id=1)
    assert len(windows) == 4 and windows.n_tokens == len(tokens)
    short = windows[0]
    assert short["input_ids"].tolist() == [5, 6, 0, 1, 1, 1, 1, 1]
    assert short["labels"].tolist() == [5, 6, 0] + [IGNORE_INDEX] * 5
    first = windows[1]
    assert first["input_ids"].tolist() == list(range(10, 18))
    assert torch.equal(first["labels"], first["input_ids"])
    assert windows[2]["labels"].tolist() == [18, 0] + [IGNORE_INDEX] * 6  # the rest of the long document
    assert windows[3]["labels"].tolist() == [7, 0] + [IGNORE_INDEX] * 6
    assert sum(int((windows[i]["labels"] != IGNORE_INDEX).sum()) for i in range(4)) == windows.n_tokens
    lone = document_windows(np.arange(9, dtype=np.uint16), np.array([9]), seq_len=8, pad_id=1)
    assert len(lone) == 1  # a last piece of one token holds no target: left out


def test_padding_is_masked_even_when_pad_is_eos():
    windows = document_windows(np.array([4, 0], dtype=np.uint16), np.array([2]), seq_len=4, pad_id=0)
    assert windows[0]["input_ids"].tolist() == [4, 0, 0, 0]
    assert windows[0]["labels"].tolist() == [4, 0, IGNORE_INDEX, IGNORE_INDEX]  # the real eos stays a target


def test_builtin_corpus_split_counts_and_no_overlap(tokenizer, cache_dir):
    data = Data(train="builtin:shakespeare", seq_len=64, validation_fraction=0.05, cache_dir=cache_dir)
    train, validation = build_datasets(data, tokenizer, seed=7)
    n_tokens = len(cached_tokens("builtin:shakespeare", "auto", "text", tokenizer, cache_dir))
    n_windows = n_tokens // 64
    n_validation = max(1, round(0.05 * n_windows))
    assert n_tokens > 300_000  # ~1 MB of English in a 4096-token BPE
    assert (len(train), len(validation)) == (n_windows - n_validation, n_validation)
    assert train.n_tokens == len(train) * 64
    train_positions = {int(s) + k for s in train.starts for k in range(64)}
    validation_positions = {int(s) + k for s in validation.starts for k in range(64)}
    assert train_positions.isdisjoint(validation_positions)
    assert len(train_positions | validation_positions) == n_windows * 64
    assert validation.starts.min() > train.starts.max()  # the held-out part is the tail
    again_train, again_validation = build_datasets(data, tokenizer, seed=99)
    assert np.array_equal(again_train.starts, train.starts)
    assert np.array_equal(again_validation.starts, validation.starts)


def test_validation_file_is_used_whole(tokenizer, cache_dir):
    data = Data(
        train="builtin:shakespeare", validation="builtin:shakespeare/validation", seq_len=64, cache_dir=cache_dir
    )
    train, validation = build_datasets(data, tokenizer, seed=0)
    n_train = len(cached_tokens("builtin:shakespeare", "auto", "text", tokenizer, cache_dir)) // 64
    n_validation = len(cached_tokens("builtin:shakespeare/validation", "auto", "text", tokenizer, cache_dir)) // 64
    assert (len(train), len(validation)) == (n_train, n_validation)
    assert validation.tokens is not train.tokens


def test_unpacked_jsonl_gives_each_document_its_own_windows(tokenizer, tmp_path):
    """Unpacked, a document starts a window of its own and goes on in as many as it needs: every token trains."""
    path = tmp_path / "qa.jsonl"
    docs = [f"Question {i}: who is Yorick? " * (1 + i % 5) for i in range(40)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    data = Data(train=str(path), seq_len=32, packing=False, validation_fraction=0.1, cache_dir=str(tmp_path))
    train, validation = build_datasets(data, tokenizer, seed=0)
    lengths = [len(tokenizer(d, add_special_tokens=False)["input_ids"]) + 1 for d in docs]
    windows = sum(-(-n // 32) - (n % 32 == 1) for n in lengths)  # a last piece of one token holds no target
    assert len(train) + len(validation) == windows and len(validation) == round(0.1 * windows)
    assert train.n_tokens + validation.n_tokens == sum(n - (n % 32 == 1) for n in lengths)
    first = train[0]
    assert int((first["labels"] != IGNORE_INDEX).sum()) == min(lengths[0], 32)


def test_too_little_text_for_one_window(tokenizer, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("Alas, poor Yorick! I knew him, Horatio.")
    n_tokens = len(tokenizer(path.read_text(), add_special_tokens=False)["input_ids"]) + 1
    data = Data(train=str(path), seq_len=1024, cache_dir=str(tmp_path))
    with pytest.raises(DataError) as excinfo:
        build_datasets(data, tokenizer, seed=0)
    [problem] = excinfo.value.problems
    assert problem.message == f"{path} has {n_tokens} tokens, fewer than one seq_len window of 1024"
    assert problem.hint == "lower data.seq_len or add text" and problem.key == "data.train"


def test_one_window_cannot_be_split(tokenizer, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("Alas, poor Yorick! I knew him, Horatio: a fellow of infinite jest.")
    n_tokens = len(tokenizer(path.read_text(), add_special_tokens=False)["input_ids"]) + 1
    data = Data(train=str(path), seq_len=n_tokens, validation_fraction=0.01, cache_dir=str(tmp_path))
    with pytest.raises(DataError, match="gives 1 window.* too few to hold 1 out"):
        build_datasets(data, tokenizer, seed=0)
    train, validation = build_datasets(data.model_copy(update={"seq_len": n_tokens // 2}), tokenizer, seed=0)
    assert (len(train), len(validation)) == (1, 1)  # a fraction of 2 windows still holds one out
    with pytest.raises(ValueError, match="greater than 0"):  # 0 read as "hold nothing out"
        Data(train=str(path), validation_fraction=0)
