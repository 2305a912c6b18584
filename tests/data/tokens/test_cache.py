"""The token cache: tokenise once, reuse by content and tokenizer, write atomically."""

from __future__ import annotations

import errno
import json
import os
import threading
import time

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import memtrain.data.tokens.cache as cache
from memtrain.data.tokens.cache import cache_paths, cached_documents, cached_tokens
from memtrain.data.tokens.tokenizer import load_tokenizer
from memtrain.errors import UserError
from memtrain.recipe.schema import Model

DOCS = ["Now is the winter of our discontent", "Made glorious summer by this sun of York;", "And all the clouds"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(Model(preset="tiny"))


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    return str(path)


@pytest.fixture
def tokenize_calls(monkeypatch):
    """Counts real tokenisation passes of the cache."""
    calls = []
    real = cache.tokenize_documents

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(cache, "tokenize_documents", counting)
    return calls


def test_tokens_are_the_documents_each_followed_by_eos(tokenizer, corpus, tmp_path):
    tokens, ends = cached_documents(corpus, "auto", "text", tokenizer, str(tmp_path / "c"))
    expected = []
    for doc in DOCS:
        expected += tokenizer(doc, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert tokens.dtype == np.uint16 and isinstance(tokens, np.memmap)
    assert tokens.tolist() == expected
    assert ends.tolist() == np.cumsum([len(tokenizer(d)["input_ids"]) + 1 for d in DOCS]).tolist()
    assert np.flatnonzero(tokens == tokenizer.eos_token_id).tolist() == (ends - 1).tolist()


def test_second_call_reuses_the_file(tokenizer, corpus, tmp_path, tokenize_calls):
    first = cached_tokens(corpus, "auto", "text", tokenizer, str(tmp_path / "c"))
    tokens_path, _ = cache_paths(corpus, "auto", "text", tokenizer, str(tmp_path / "c"))
    written_ns = tokens_path.stat().st_mtime_ns
    second = cached_tokens(corpus, "auto", "text", tokenizer, str(tmp_path / "c"))
    assert len(tokenize_calls) == 1
    assert tokens_path.stat().st_mtime_ns == written_ns
    assert np.array_equal(first, second)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == sorted(
        [tokens_path.name, tokens_path.name.replace(".tokens.", ".doc_ends."), cache.sums_path(tokens_path).name]
    )  # no temporary files left


def test_new_content_or_tokenizer_gives_a_new_entry(tokenizer, corpus, tmp_path, tokenize_calls):
    cache_dir = str(tmp_path / "c")
    before = cached_tokens(corpus, "auto", "text", tokenizer, cache_dir)
    with open(corpus, "a") as handle:
        handle.write(json.dumps({"text": "Upon our house"}) + "\n")
    after = cached_tokens(corpus, "auto", "text", tokenizer, cache_dir)
    assert len(after) > len(before)

    other = load_tokenizer(Model(preset="tiny"))
    other.add_tokens(["winter"])
    with_other = cached_tokens(corpus, "auto", "text", other, cache_dir)
    assert other.convert_tokens_to_ids("winter") in with_other.tolist()
    assert len(tokenize_calls) == 3
    assert len(list((tmp_path / "c").glob("*.tokens.npy"))) == 3


def test_cache_dir_defaults_to_the_environment(tokenizer, corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("MEMTRAIN_CACHE", str(tmp_path / "env-cache"))
    cached_tokens(corpus, "auto", "text", tokenizer, None)
    assert len(list((tmp_path / "env-cache").glob("*.tokens.npy"))) == 1


def test_damaged_entry_is_rebuilt(tokenizer, corpus, tmp_path, tokenize_calls):
    good = np.array(cached_tokens(corpus, "auto", "text", tokenizer, str(tmp_path)))
    tokens_path, _ = cache_paths(corpus, "auto", "text", tokenizer, str(tmp_path))
    tokens_path.write_bytes(tokens_path.read_bytes()[:100])  # a half-written file from elsewhere
    assert np.array_equal(cached_tokens(corpus, "auto", "text", tokenizer, str(tmp_path)), good)
    assert len(tokenize_calls) == 2


def test_concurrent_writers_agree(tokenizer, corpus, tmp_path):
    results, errors = [], []

    def build():
        try:
            results.append(np.array(cached_tokens(corpus, "auto", "text", tokenizer, str(tmp_path))))
        except Exception as err:  # surfaced by the assert below
            errors.append(err)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(results) == 3
    assert all(np.array_equal(r, results[0]) for r in results)


def test_literal_special_token_text_is_not_a_separator(tokenizer, tmp_path):
    path = tmp_path / "tricky.txt"
    path.write_text("before <|endoftext|> after")
    tokens = cached_tokens(str(path), "auto", "text", tokenizer, str(tmp_path / "c"))
    assert np.count_nonzero(tokens == tokenizer.eos_token_id) == 1 and tokens[-1] == tokenizer.eos_token_id


def test_large_vocabulary_is_stored_as_uint32(tmp_path):
    vocab = {"<eos>": 0, "<unk>": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    big = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>")
    path = tmp_path / "words.txt"
    path.write_text("w69999 w3 w65535")
    tokens = cached_tokens(str(path), "auto", "text", big, str(tmp_path / "c"))
    assert tokens.dtype == np.uint32
    assert tokens.tolist() == [70_001, 5, 65_537, 0]


def test_unwritable_cache_dir(tokenizer, corpus, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(UserError) as excinfo:
        cached_tokens(corpus, "auto", "text", tokenizer, str(blocker / "cache"))
    [problem] = excinfo.value.problems
    assert problem.key == "data.cache_dir" and "cannot write the token cache" in problem.message


def test_a_full_disk_says_so_with_the_entrys_size_and_leaves_no_part_of_the_entry(
    tokenizer, corpus, tmp_path, monkeypatch
):
    real_save = np.save

    def full_at_tokens(handle, array):
        if array.dtype != np.int64:  # the ends are written first; the tokens after them do not fit
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(handle, array)

    monkeypatch.setattr(cache.np, "save", full_at_tokens)
    with pytest.raises(UserError) as excinfo:
        cached_tokens(corpus, "auto", "text", tokenizer, str(tmp_path / "c"))
    [problem] = excinfo.value.problems
    assert problem.key == "data.cache_dir" and "filesystem is full (this entry needs" in problem.message
    assert problem.hint.startswith("free some space there")
    assert list((tmp_path / "c").iterdir()) == []  # the ends file written before is gone, and no temporary is left


def test_a_killed_writes_old_temporaries_are_removed_by_the_next_write_and_live_ones_kept(tokenizer, corpus, tmp_path):
    tokens_path, ends_path = cache_paths(corpus, "auto", "text", tokenizer, str(tmp_path / "c"))
    tokens_path.parent.mkdir(parents=True)
    old, live = (tokens_path.parent / f".{tokens_path.name}.{tag}.tmp" for tag in ("s8cx6h8_", "abcd1234"))
    for leftover in (old, live):
        leftover.write_bytes(b"\0" * 1000)
    os.utime(old, (time.time() - cache.STALE_S - 5,) * 2)  # a kill -9 eleven minutes ago
    cached_tokens(corpus, "auto", "text", tokenizer, str(tmp_path / "c"))
    assert not old.exists() and live.exists()
    assert sorted(p.name for p in tokens_path.parent.iterdir()) == sorted(
        [live.name, tokens_path.name, ends_path.name, cache.sums_path(tokens_path).name]
    )


def test_a_short_write_with_no_room_left_is_a_full_disk_too(tokenizer, corpus, tmp_path, monkeypatch):
    def short(handle, array):  # how numpy says a full disk while it writes an array: no errno
        raise OSError(f"{array.nbytes} requested and 1089472 written")

    monkeypatch.setattr(cache.np, "save", short)
    for room, said in ((10, "filesystem is full (this entry needs"), (10**15, "requested and 1089472 written")):
        monkeypatch.setattr(cache, "_room", lambda directory, room=room: room)
        with pytest.raises(UserError) as excinfo:
            cached_tokens(corpus, "auto", "text", tokenizer, str(tmp_path / "c"))
        assert said in excinfo.value.problems[0].message


def test_old_temporaries_of_other_entries_go_too(tokenizer, corpus, tmp_path):
    cache_dir = tmp_path / "c"
    cache_dir.mkdir()
    other_old, other_live = cache_dir / ".0ther.tokens.npy.s8cx6h8_.tmp", cache_dir / ".0ther.ends.npy.abcd1234.tmp"
    for leftover in (other_old, other_live):
        leftover.write_bytes(b"\0" * 100)
    os.utime(other_old, (time.time() - cache.STALE_S - 5,) * 2)
    cached_tokens(corpus, "auto", "text", tokenizer, str(cache_dir))
    assert not other_old.exists() and other_live.exists()


def zero_fill(path, offset: int = 0, size: int = 65536) -> None:
    """Zeros over part of a file, its size unchanged (as `dd conv=notrunc` writes them)."""
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(b"\0" * min(size, path.stat().st_size - offset))


def random_fill(path) -> None:
    path.write_bytes(np.random.default_rng(0).bytes(path.stat().st_size))


@pytest.mark.parametrize("damage", [lambda p: zero_fill(p, offset=128), random_fill])
def test_an_entry_whose_bytes_changed_at_the_same_size_is_tokenised_again_with_a_line(
    tokenizer, corpus, tmp_path, tokenize_calls, capsys, damage
):
    """A zero-filled token cache of the same size was trained on without a word (loss 0.80 instead of 6.74), and
    random bytes gave an IndexError traceback."""
    good = np.array(cached_tokens(corpus, "auto", "text", tokenizer, str(tmp_path)))
    tokens_path, _ = cache_paths(corpus, "auto", "text", tokenizer, str(tmp_path))
    damage(tokens_path)
    assert np.array_equal(cached_tokens(corpus, "auto", "text", tokenizer, str(tmp_path)), good)
    assert len(tokenize_calls) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "token cache entry" in said[0] and "tokenising the data again" in said[0], said
    assert f"holds other bytes in {tokens_path.name}" in said[0] or "bytes in" in said[0]
    assert cache.damaged_entries()[-1].startswith(f"{tmp_path / tokens_path.name.split('.')[0]}: holds")
    cached_tokens(corpus, "auto", "text", tokenizer, str(tmp_path))
    assert len(tokenize_calls) == 2 and capsys.readouterr().err == ""  # rebuilt whole: trusted again, silently


def test_an_entry_without_its_record_of_checksums_is_tokenised_again(tokenizer, corpus, tmp_path, tokenize_calls):
    cached_tokens(corpus, "auto", "text", tokenizer, str(tmp_path))
    tokens_path, _ = cache_paths(corpus, "auto", "text", tokenizer, str(tmp_path))
    cache.sums_path(tokens_path).unlink()  # an older memtrain's entry, or a write killed before the record
    cached_tokens(corpus, "auto", "text", tokenizer, str(tmp_path))
    assert len(tokenize_calls) == 2 and cache.sums_path(tokens_path).is_file()


def test_a_large_entry_is_hashed_again_only_when_a_file_was_written_since(tmp_path, monkeypatch):
    """Above FULL_HASH_BELOW_BYTES the size is compared on every load and the bytes only when a file's modification
    time is not the one recorded, which any write through the filesystem changes."""
    monkeypatch.setattr(cache, "FULL_HASH_BELOW_BYTES", 0)
    paths = [tmp_path / "k.ends.npy", tmp_path / "k.tokens.npy"]
    cache.write_entry([(paths[0], np.arange(4, dtype=np.int64)), (paths[1], np.arange(1000, dtype=np.uint16))])
    hashed = []
    real = cache._sha256
    monkeypatch.setattr(cache, "_sha256", lambda path: hashed.append(path.name) or real(path))
    assert cache.entry_problem(paths) is None and hashed == []
    zero_fill(paths[1], offset=200, size=100)
    assert "checksum differs" in cache.entry_problem(paths) and hashed == ["k.tokens.npy"]


def test_a_damaged_entry_of_a_dataset_list_is_tokenised_again(tokenizer, corpus, tmp_path, monkeypatch, capsys):
    """The entries of a recipe's list of datasets (tokenized.py) share write_entry and the same check."""
    from memtrain.data.tokens import tokenized
    from memtrain.recipe.schema import DatasetSpec

    spec, rules = DatasetSpec(path=corpus, type="text"), tokenized.SampleRules(template=None)
    good = tokenized.tokenized_dataset(spec, tokenizer, rules, str(tmp_path))
    good_tokens = np.array(good.tokens)
    [tokens_path] = tmp_path.glob("*.tokens.npy")
    calls = []
    real = tokenized.tokenize_dataset
    monkeypatch.setattr(tokenized, "tokenize_dataset", lambda *a: calls.append(1) or real(*a))
    zero_fill(tokens_path, offset=128)
    again = tokenized.tokenized_dataset(spec, tokenizer, rules, str(tmp_path))
    assert calls == [1] and np.array_equal(np.array(again.tokens), good_tokens)
    assert "tokenising the data again" in capsys.readouterr().err
