"""A data file is hashed once per version: a warm start finds its token-cache entry without reading the file,
and any change to the file (even one that keeps its size and mtime) is hashed again."""

from __future__ import annotations

import json
import os

import pytest

import memtrain.data.read.corpus as corpus
import memtrain.data.read.records as records
from memtrain.data.read import file_memo
from memtrain.data.read.corpus import source_fingerprint
from memtrain.data.read.records import dataset_fingerprint
from memtrain.data.rows.dataset import build_datasets

CHAT = [
    {"messages": [{"role": "user", "content": f"What is {i} plus {i}?"}, {"role": "assistant", "content": str(2 * i)}]}
    for i in range(40)
]


@pytest.fixture
def hashed(monkeypatch):
    """{module: how many times it read a data file's bytes to hash them}, from a clean process memo."""
    counts = {"records": 0, "corpus": 0}
    for name, module in (("records", records), ("corpus", corpus)):
        original = module.digest_file

        def counting(digest, path, name=name, original=original):
            counts[name] += 1
            original(digest, path)

        monkeypatch.setattr(module, "digest_file", counting)
    file_memo.forget()
    yield counts
    file_memo.forget()


@pytest.fixture
def settled(monkeypatch):
    """Files written by the test count as settled (a user's data files are seconds to years old)."""
    monkeypatch.setattr(file_memo, "RACY_S", -60.0)


def write_chat(path, rows=CHAT):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_file_is_hashed_once_then_remembered_in_the_process_and_on_disk(tmp_path, hashed, settled):
    data = write_chat(tmp_path / "chat.jsonl")
    memo = tmp_path / "cache"
    first = dataset_fingerprint(str(data), None, memo)
    assert hashed["records"] == 1
    assert dataset_fingerprint(str(data), None, memo) == first and hashed["records"] == 1  # this process
    file_memo.forget()
    assert dataset_fingerprint(str(data), None, memo) == first and hashed["records"] == 1  # the file under the cache
    assert len(list((memo / file_memo.MEMO_DIR).iterdir())) == 1
    file_memo.forget()
    assert dataset_fingerprint(str(data)) == first and hashed["records"] == 2  # the same value, hashed again


def test_a_rewrite_that_keeps_size_and_mtime_is_hashed_again(tmp_path, hashed, settled):
    data = write_chat(tmp_path / "chat.jsonl")
    memo = tmp_path / "cache"
    before = dataset_fingerprint(str(data), None, memo)
    stat = data.stat()
    text = data.read_text()
    data.write_text(text.replace("What is 3 plus 3?", "What is 3 plus 4?"))  # same length
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # mtime put back, as `touch -r` or rsync -t would
    assert data.stat().st_size == stat.st_size and data.stat().st_mtime_ns == stat.st_mtime_ns
    after = dataset_fingerprint(str(data), None, memo)
    assert after != before and hashed["records"] == 2  # ctime moved: another version
    file_memo.forget()
    assert dataset_fingerprint(str(data)) == after


def test_a_file_changed_just_now_is_not_remembered(tmp_path, hashed):
    data = write_chat(tmp_path / "chat.jsonl")  # RACY_S as shipped: a write within it may share the stat identity
    memo = tmp_path / "cache"
    dataset_fingerprint(str(data), None, memo)
    dataset_fingerprint(str(data), None, memo)
    assert hashed["records"] == 2 and not (memo / file_memo.MEMO_DIR).exists()


def test_split_format_and_field_are_part_of_what_is_remembered(tmp_path, hashed, settled):
    data = write_chat(tmp_path / "chat.jsonl")
    memo = tmp_path / "cache"
    assert dataset_fingerprint(str(data), "train", memo) != dataset_fingerprint(str(data), "test", memo)
    text = tmp_path / "docs.jsonl"
    text.write_text('{"text": "a", "body": "b"}\n')
    values = {
        source_fingerprint(str(text), "auto", "text", memo),
        source_fingerprint(str(text), "auto", "body", memo),
        source_fingerprint(str(text), "text", "text", memo),
    }
    assert len(values) == 3 and hashed["corpus"] == 3
    file_memo.forget()
    assert source_fingerprint(str(text), "auto", "body", memo) in values and hashed["corpus"] == 3


def test_a_cache_that_cannot_be_written_only_means_hashing_again(tmp_path, hashed, settled):
    data = write_chat(tmp_path / "chat.jsonl")
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    value = dataset_fingerprint(str(data), None, blocked)
    file_memo.forget()
    assert dataset_fingerprint(str(data), None, blocked) == value and hashed["records"] == 2


def test_a_damaged_memo_file_is_ignored(tmp_path, hashed, settled):
    data = write_chat(tmp_path / "chat.jsonl")
    memo = tmp_path / "cache"
    value = dataset_fingerprint(str(data), None, memo)
    (entry,) = (memo / file_memo.MEMO_DIR).iterdir()
    entry.write_text("half-writ")
    file_memo.forget()
    assert dataset_fingerprint(str(data), None, memo) == value and hashed["records"] == 2


def test_a_warm_build_of_chat_data_reads_no_data_file_to_find_its_cache_entry(
    tmp_path, hashed, settled, chat_tokenizer, make_data
):
    data = write_chat(tmp_path / "chat.jsonl")
    recipe_data = make_data(train=[{"path": str(data), "type": "chat"}])
    cold, _ = build_datasets(recipe_data, chat_tokenizer, seed=0)
    cold_hashes = hashed["records"]
    file_memo.forget()  # as a new process
    warm, _ = build_datasets(recipe_data, chat_tokenizer, seed=0)
    assert cold_hashes == 1 and hashed["records"] == 1
    assert [warm[i]["input_ids"].tolist() for i in range(len(warm))] == [
        cold[i]["input_ids"].tolist() for i in range(len(cold))
    ]
    data.write_text(data.read_text().replace('"2"}', '"two"}'))  # an answer changed: tokenised again
    changed, _ = build_datasets(recipe_data, chat_tokenizer, seed=0)
    assert hashed["records"] == 2
    assert sum(len(r["input_ids"]) for r in (changed[i] for i in range(len(changed)))) > 0
    assert [changed[i]["labels"].tolist() for i in range(len(changed))] != [
        cold[i]["labels"].tolist() for i in range(len(cold))
    ]


def test_a_renamed_link_in_a_dataset_directory_is_another_version_and_the_memo_is_readable_by_all(
    tmp_path, hashed, settled
):
    target = write_chat(tmp_path / "a.jsonl")
    folder = tmp_path / "dataset"
    folder.mkdir()
    (folder / "x.jsonl").symlink_to(target)
    memo = tmp_path / "cache"
    before = dataset_fingerprint(str(folder), None, memo)
    (folder / "x.jsonl").rename(folder / "y.jsonl")  # the member's name is hashed; its target is the same file
    after = dataset_fingerprint(str(folder), None, memo)
    file_memo.forget()
    assert after != before and after == dataset_fingerprint(str(folder))
    assert {entry.stat().st_mode & 0o777 for entry in (memo / file_memo.MEMO_DIR).iterdir()} == {0o644}
