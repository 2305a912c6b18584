"""A system prompt in a field the dataset does not read (LLaMA-Factory's "system" column, OpenOrca's "system_prompt")
is warned about; naming the field reads it and the warning goes (audit 21: it was dropped without a word)."""
from __future__ import annotations

from memtrain.data.dataset import build_datasets
from memtrain.data.mixture import unread_system_warning

ALPACA = {"instruction": "Add 2 and 3.", "input": "", "output": "5", "system": "You are a pirate."}
SHAREGPT = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Arr"}],
            "system_prompt": "You are a pirate."}


def test_an_unread_system_field_is_warned_about_and_a_named_one_is_read(chat_tokenizer, write_jsonl, make_data):
    alpaca, sharegpt = write_jsonl("alpaca.jsonl", [ALPACA] * 4), write_jsonl("sharegpt.jsonl", [SHAREGPT] * 4)
    data = make_data(train=[{"path": alpaca, "type": "instruction"}, {"path": sharegpt, "type": "chat"}], seq_len=64)
    assert unread_system_warning(data) == (
        f"the records of {alpaca} (its 'system' field; system_field: system reads it); {sharegpt} (its "
        "'system_prompt' field; system_field: system_prompt reads it) hold a system prompt that is not read: the "
        "model trains without it — set the dataset's system_field to train with it as the system message, or leave "
        "it out of the files")
    read = make_data(train=[{"path": alpaca, "type": "instruction", "system_field": "system"},
                            {"path": sharegpt, "type": "chat", "system_field": "system_prompt"}], seq_len=64)
    assert unread_system_warning(read) is None
    train_unread, _ = build_datasets(data, chat_tokenizer, seed=0)
    train_read, _ = build_datasets(read, chat_tokenizer, seed=0)
    assert train_read.stats.tokens > train_unread.stats.tokens  # the prompt is in the rows once it is read
    plain = write_jsonl("plain.jsonl", [{k: v for k, v in ALPACA.items() if k != "system"}] * 4)
    assert unread_system_warning(make_data(train=[{"path": plain, "type": "instruction"}], seq_len=64)) is None
