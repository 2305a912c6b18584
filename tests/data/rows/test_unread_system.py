"""A system prompt in a field the dataset does not read (LLaMA-Factory's "system" column, OpenOrca's "system_prompt")
is counted as the records are read and warned about, the count surviving the token cache as the other data
warnings' counts do; naming the field reads it and the warning goes (it was dropped without a word)."""

from __future__ import annotations

from memtrain.data.rows.dataset import build_datasets
from memtrain.data.rows.mixture import unread_system_warning

ALPACA = {"instruction": "Add 2 and 3.", "input": "", "output": "5"}
SHAREGPT = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Arr"}]}
PIRATE = "You are a pirate."


def test_an_unread_system_field_is_counted_and_warned_about_and_a_named_one_is_read(
    chat_tokenizer, write_jsonl, make_data
):
    alpaca = write_jsonl(
        "alpaca.jsonl", [ALPACA, {**ALPACA, "system": PIRATE}, {**ALPACA, "system": PIRATE}, {**ALPACA, "system": " "}]
    )
    sharegpt = write_jsonl("sharegpt.jsonl", [{**SHAREGPT, "system_prompt": PIRATE}] * 4)
    data = make_data(train=[{"path": alpaca, "type": "instruction"}, {"path": sharegpt, "type": "chat"}], seq_len=64)
    for _ in range(2):  # tokenised, then read back from the cache with its notes
        train_unread, _ = build_datasets(data, chat_tokenizer, seed=0)
        assert unread_system_warning(data, chat_tokenizer) == (
            f"a system prompt is not read from the 'system' field of 2 records of {alpaca} (the first at line 2) "
            f"(system_field: system reads it); the 'system_prompt' field of 4 records of {sharegpt} (the first at "
            "line 1) (system_field: system_prompt reads it): the model trains without it — set the dataset's "
            "system_field to train with it as the system message, or leave it out of the files"
        )
    read = make_data(
        train=[
            {"path": alpaca, "type": "instruction", "system_field": "system"},
            {"path": sharegpt, "type": "chat", "system_field": "system_prompt"},
        ],
        seq_len=64,
    )
    train_read, _ = build_datasets(read, chat_tokenizer, seed=0)
    assert unread_system_warning(read, chat_tokenizer) is None
    assert train_read.stats.tokens > train_unread.stats.tokens  # the prompt is in the rows once it is read
    plain = write_jsonl("plain.jsonl", [ALPACA] * 4)
    none = make_data(train=[{"path": plain, "type": "instruction"}], seq_len=64)
    build_datasets(none, chat_tokenizer, seed=0)
    assert unread_system_warning(none, chat_tokenizer) is None
