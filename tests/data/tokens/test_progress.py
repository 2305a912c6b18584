"""The first tokenisation of a data file reports how far it has got, and a command draws it as a bar on a terminal;
data from the token cache reports nothing."""

from __future__ import annotations

import io
import json

from rich.console import Console

from memtrain.data.rows.dataset import build_datasets
from memtrain.data.tokens.progress import listening
from memtrain.train.progress_bar import tokenising_progress

CHAT = [
    {"messages": [{"role": "user", "content": f"What is {i} plus {i}?"}, {"role": "assistant", "content": str(2 * i)}]}
    for i in range(1200)
]


def test_a_cold_chat_build_reports_its_records_and_a_warm_one_nothing(chat_tokenizer, make_data, tmp_path):
    path = tmp_path / "sums.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    data = make_data(train=[{"path": str(path), "type": "chat"}])
    heard = []
    with listening(lambda what, done, total: heard.append((what, done, total))):
        build_datasets(data, chat_tokenizer, seed=0)
    assert {what for what, _, _ in heard} == {"tokenising sums.jsonl"}
    assert [done for _, done, _ in heard] == sorted(done for _, done, _ in heard) and heard[-1][1:] == (1200, 1200)
    assert len(heard) > 2  # batch by batch, not only at the end
    heard.clear()
    with listening(lambda *report: heard.append(report)):
        build_datasets(data, chat_tokenizer, seed=0)
    assert heard == []


def test_the_bar_is_drawn_on_a_terminal_and_not_elsewhere(chat_tokenizer, make_data, tmp_path):
    for terminal in (True, False):
        path = tmp_path / f"sums-{terminal}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in CHAT))
        screen = io.StringIO()
        with tokenising_progress(Console(file=screen, force_terminal=terminal, width=100)):
            build_datasets(make_data(train=[{"path": str(path), "type": "chat"}]), chat_tokenizer, seed=0)
        assert ("tokenising sums-True.jsonl" in screen.getvalue()) == terminal
        assert screen.getvalue() != "" or not terminal
