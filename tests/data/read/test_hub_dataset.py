"""A dataset by Hub name (`path: hub:org/name`, split, subset), read offline from a Hub cache laid out as
huggingface_hub lays it out: the same samples as the same records from a local file, fields mapped with the dataset's
*_field keys, the fingerprint the commit's."""

from __future__ import annotations

import json

import pytest

from memtrain.data.read.records import dataset_fingerprint, read_records
from memtrain.data.rows.dataset import build_datasets
from memtrain.errors import UserError
from tests.conftest import ROOT
from tests.hub_cache import add_dataset_snapshot

CHAT = (ROOT / "memtrain" / "assets" / "chat" / "validation.jsonl").read_text().splitlines()[:48]
CARD = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train.jsonl
  - split: test
    path: data/test.jsonl
- config_name: dialog
  data_files:
  - split: train
    path: dialog/train.jsonl
---
# A chat dataset
"""


def jsonl(records) -> bytes:
    return ("\n".join(json.dumps(r) for r in records) + "\n").encode()


def repo_files() -> dict[str, bytes]:
    records = [json.loads(line) for line in CHAT]
    return {
        "README.md": CARD.encode(),
        "data/train.jsonl": jsonl(records[:40]),
        "data/test.jsonl": jsonl(records[40:]),
        # another subset whose messages sit in another field
        "dialog/train.jsonl": jsonl([{"dialog": r["messages"]} for r in records[:40]]),
    }


def rows(dataset) -> list[list[int]]:
    return [dataset[i]["input_ids"].tolist() for i in range(len(dataset))]


def test_a_hub_dataset_gives_the_samples_its_records_give_from_a_file(hub_cache, make_data, chat_tokenizer, tmp_path):
    add_dataset_snapshot(hub_cache, "org/chat", repo_files())
    local, local_test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    local.write_text("\n".join(CHAT[:40]) + "\n")
    local_test.write_text("\n".join(CHAT[40:]) + "\n")
    held_out = {"path": "hub:org/chat", "type": "chat", "split": "test"}
    by_name = make_data(train=[{"path": "hub:org/chat", "type": "chat"}], validation=[held_out], seq_len=64)
    by_file = make_data(
        train=[{"path": str(local), "type": "chat"}], validation=[{"path": str(local_test), "type": "chat"}], seq_len=64
    )
    train_hub, val_hub = build_datasets(by_name, chat_tokenizer, seed=0)
    train_file, val_file = build_datasets(by_file, chat_tokenizer, seed=0)
    assert len(train_hub) > 0 and rows(train_hub) == rows(train_file)
    assert len(val_hub) > 0 and rows(val_hub) == rows(val_file)
    assert [line for line, _ in read_records("hub:org/chat", "test")] == list(range(1, 9))  # rows, numbered from 1
    # a subset whose field differs: the dataset's messages_field maps it
    mapped = make_data(
        train=[{"path": "hub:org/chat", "type": "chat", "subset": "dialog", "messages_field": "dialog"}],
        validation=[held_out],
        seq_len=64,
    )
    assert rows(build_datasets(mapped, chat_tokenizer, seed=0)[0]) == rows(train_file)


def test_the_fingerprint_is_the_commits(hub_cache):
    first = add_dataset_snapshot(hub_cache, "org/chat", repo_files())
    before = dataset_fingerprint("hub:org/chat", "train")
    assert dataset_fingerprint("hub:org/chat", "test") != before  # the split is part of it
    files = repo_files()
    files["data/train.jsonl"] += (
        b'{"messages": [{"role": "user", "content": "1?"}, {"role": "assistant", "content": "1"}]}\n'
    )
    assert add_dataset_snapshot(hub_cache, "org/chat", files) != first  # main moves on
    assert dataset_fingerprint("hub:org/chat", "train") != before


def test_a_dataset_missing_from_the_cache_offline_is_said(hub_cache):
    with pytest.raises(UserError) as error:
        list(read_records("hub:org/absent"))
    said = error.value.problems[0]
    assert "Hub dataset 'org/absent'" in said.message and "HF_HUB_OFFLINE" in said.message
