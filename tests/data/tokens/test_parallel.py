"""Chat records are encoded in forked workers when there are enough of them, with the same samples, notes and
problems, in the same order, as in one process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import memtrain.data.tokens.tokenized as tokenized
from memtrain.data.rows.dataset import build_datasets
from memtrain.data.tokens import parallel
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
    data = make_data(
        train=[{"path": str(path), "type": "chat"}],
        skip_untrainable=True,
        seq_len=64,
        cache_dir=str(path.parent / f"cache-{min_batches}"),
    )
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
        build_datasets(
            make_data(train=[{"path": str(path), "type": "chat"}], template="alpaca", skip_untrainable=True),
            chat_tokenizer,
            seed=0,
        )
    assert [p.line for p in err.value.problems] == [21, 151]
    assert all(p.key == "data.template" for p in err.value.problems)


@pytest.mark.parametrize("min_batches", [10**9, 1], ids=["one process", "workers"])
def test_tokenising_stops_once_ten_problems_are_found(chat_tokenizer, make_data, tmp_path, monkeypatch, min_batches):
    """A template that cannot write some records was said only after every record was tokenised."""
    records = conversations(400)
    bad = list(range(5, 400, 9))  # 45 records the alpaca template cannot write, 12 of them in the first 7 batches
    for i in bad:
        records[i]["messages"].insert(2, {"role": "system", "content": "Be brief."})
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    monkeypatch.setattr(parallel, "MIN_BATCHES", min_batches)
    monkeypatch.setattr(tokenized, "BATCH_RECORDS", 16)
    encoded = []
    encode_many = tokenized.ConversationEncoder.encode_many
    monkeypatch.setattr(
        tokenized.ConversationEncoder,
        "encode_many",
        lambda self, batch: encoded.append(len(batch)) or encode_many(self, batch),
    )
    with pytest.raises(DataError) as err:
        build_datasets(
            make_data(
                train=[{"path": str(path), "type": "chat"}],
                template="alpaca",
                skip_untrainable=True,
                cache_dir=str(tmp_path / "cache"),
            ),
            chat_tokenizer,
            seed=0,
        )
    problems = err.value.problems
    assert [p.line for p in problems[:10]] == [i + 1 for i in bad[:10]]  # lines count from 1
    # the tenth is record 86, in the sixth batch (records 80-95): checking stops after that batch's last line
    assert (
        problems[10].message == "… checking stopped after line 96 (1 more problem up to there, the lines after "
        "it were not checked)"
    )
    assert len(problems) == 11 and err.value.count == "at least 11 problems, the first 10 listed"
    if min_batches > 1:  # in this process: the batches after it were never encoded (workers may run ahead)
        assert len(encoded) == 6


@pytest.mark.parametrize("min_batches", [10**9, 1], ids=["one process", "workers"])
def test_batches_are_read_a_few_ahead_of_the_one_yielded(monkeypatch, min_batches):
    """Every parsed record was held before the first was encoded (ten times the file's bytes)."""
    monkeypatch.setattr(parallel, "MIN_BATCHES", min_batches)
    monkeypatch.setattr(parallel, "MAX_WORKERS", 2)
    drawn = []

    def batches():
        for i in range(100):
            drawn.append(i)
            yield [i, i + 1]

    results = parallel.map_batches(sum, batches(), 100)
    assert next(results) == ([0, 1], 1)
    workers = parallel.worker_count(100)
    assert len(drawn) == (1 if workers == 1 else parallel.LOOKAHEAD * workers)
    assert list(results) == [([i, i + 1], 2 * i + 1) for i in range(1, 100)]


CHILD = """
import signal, sys, time
from memtrain.data.tokens import parallel
def stop(signum, frame):
    raise KeyboardInterrupt  # as memtrain run's handler raises Stopped
signal.signal(signal.SIGTERM, stop)
parallel.MIN_BATCHES = 1
def slow(batch):
    time.sleep(0.3)
    return batch
try:
    for _, result in parallel.map_batches(slow, iter(range(200)), 200):
        print("result", result, flush=True)
except KeyboardInterrupt:
    print("stopped", flush=True)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_workers_end_quietly_when_the_command_is_stopped_or_killed(signum):
    """SIGTERM to the command (its handler raises) or kill -9 of it left a traceback per worker."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(parallel.__file__).parents[3])},
    )
    assert child.stdout.readline().startswith("result")  # the workers are at work
    workers = [
        int(p) for p in subprocess.run(["pgrep", "-P", str(child.pid)], capture_output=True, text=True).stdout.split()
    ]
    child.send_signal(signum)
    out, err = child.communicate(timeout=30)  # the pipes close only when the workers are gone too
    assert "Traceback" not in err, err
    assert ("stopped" in out) == (signum == signal.SIGTERM)
    assert len(workers) >= 1
    deadline = time.monotonic() + 30  # a worker lets go of the pipes a moment before it exits
    while _live(workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _live(workers)


def _live(pids: list[int]) -> list[int]:
    """The processes of `pids` still running (gone or a zombie is not)."""
    live = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            continue
        if state != "Z":
            live.append(pid)
    return live
