"""Chat records are encoded in forked workers when there are enough of them, with the same samples, notes and
problems, in the same order, as in one process."""
from __future__ import annotations

import json
import os

import pytest

import memtrain.data.tokenized as tokenized
from memtrain.data import parallel
from memtrain.data.dataset import build_datasets
from memtrain.errors import DataError


def conversations(n: int) -> list:
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": f"What is {i} times 3?"}, {"role": "assistant", "content": str(3 * i)}]
        if i % 7 == 0:
            messages = [{"role": "system", "content": "Answer with a number."}] + messages
        if i % 11 == 0:
            messages += [{"role": "user", "content": "Thanks."}]  # goes on past its last answer: a note
        if i % 13 == 0:
            messages[-1 if messages[-1]["role"] == "assistant" else -2]["content"] = ""  # nothing to train on
        out.append({"messages": messages})
    return out


def built(chat_tokenizer, make_data, path, min_batches: int, monkeypatch):
    monkeypatch.setattr(parallel, "MIN_BATCHES", min_batches)
    monkeypatch.setattr(tokenized, "BATCH_RECORDS", 16)
    data = make_data(train=[{"path": str(path), "type": "chat"}], skip_untrainable=True, seq_len=64,
                     cache_dir=str(path.parent / f"cache-{min_batches}"))
    train, validation = build_datasets(data, chat_tokenizer, seed=0)
    rows = [train[i]["input_ids"].tolist() + train[i]["labels"].tolist() for i in range(len(train))]
    return rows, [validation[i]["labels"].tolist() for i in range(len(validation))], train.stats


def test_workers_build_what_one_process_builds(chat_tokenizer, make_data, tmp_path, monkeypatch):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in conversations(300)))
    monkeypatch.setattr(parallel, "MAX_WORKERS", 2)
    assert parallel.worker_count(19) == min(2, len(os.sched_getaffinity(0)))
    serial = built(chat_tokenizer, make_data, path, 10**9, monkeypatch)
    forked = built(chat_tokenizer, make_data, path, 1, monkeypatch)
    assert forked == serial and len(serial[0]) > 10


def test_problems_found_in_workers_are_said_in_line_order(chat_tokenizer, make_data, tmp_path, monkeypatch):
    records = conversations(200)
    for i in (150, 20):  # a system message after the first turn: the alpaca template cannot write it
        records[i]["messages"].insert(2, {"role": "system", "content": "Be brief."})
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    monkeypatch.setattr(parallel, "MIN_BATCHES", 1)
    monkeypatch.setattr(tokenized, "BATCH_RECORDS", 16)
    with pytest.raises(DataError) as err:
        build_datasets(make_data(train=[{"path": str(path), "type": "chat"}], template="alpaca",
                                 skip_untrainable=True), chat_tokenizer, seed=0)
    assert [p.line for p in err.value.problems] == [21, 151]
    assert all(p.key == "data.template" for p in err.value.problems)
