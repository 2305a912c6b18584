"""A conversation that goes on past its last answer (a user or system message after the last assistant message) is
kept as it is, and counted and warned about: which dataset, how many, the first one's line; the count survives the
token cache, as the other data warnings' counts do."""

from __future__ import annotations

from memtrain.data.rows.dataset import build_datasets
from memtrain.data.rows.mixture import trailing_turns_warning
from memtrain.recipe.schema import Recipe
from memtrain.train.setup import build_data

IGNORE = -100
ANSWERED = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]
THANKS = {"role": "user", "content": "Thanks!"}
LATE_SYSTEM = {"role": "system", "content": "The user left."}


def records() -> list[dict]:
    return [
        {"messages": ANSWERED},
        {"messages": [*ANSWERED, THANKS]},
        {"messages": ANSWERED},
        {"messages": [*ANSWERED, LATE_SYSTEM]},
        {"messages": [*ANSWERED, THANKS, ANSWERED[1], THANKS]},
    ]


def test_conversations_after_their_last_answer_are_counted_and_warned_about(chat_tokenizer, write_jsonl, make_data):
    path = write_jsonl("chat.jsonl", records())
    data = make_data(train=[{"path": path, "type": "chat"}], seq_len=64)
    for _ in range(2):  # tokenised, then read back from the cache with its notes
        build_datasets(data, chat_tokenizer, seed=0)
        warning = trailing_turns_warning(data, chat_tokenizer)
        assert warning is not None
        assert warning.startswith(
            f"3 conversations of {path} (the first at line 2) end with a user or system "
            "message after the last assistant message"
        )
        assert "teach nothing" in warning and "end each conversation with its answer" in warning
    on_inputs = make_data(train=[{"path": path, "type": "chat"}], seq_len=64, train_on_inputs=True)
    build_datasets(on_inputs, chat_tokenizer, seed=0)
    assert "are trained on as targets (data.train_on_inputs)" in trailing_turns_warning(on_inputs, chat_tokenizer)
    one = write_jsonl("one.jsonl", records()[:2])
    single = make_data(train=[{"path": one, "type": "chat"}], seq_len=64, validation_fraction=0.5)
    build_datasets(single, chat_tokenizer, seed=0)
    assert trailing_turns_warning(single, chat_tokenizer).startswith(
        f"1 conversation of {one} (the first at line 2) ends with a user or system message"
    )


def test_conversations_that_end_with_their_answer_are_not_warned_about(chat_tokenizer, write_jsonl, make_data):
    path = write_jsonl("chat.jsonl", [{"messages": ANSWERED}] * 4)
    instructions = write_jsonl("alpaca.jsonl", [{"instruction": "Add 2 and 3.", "output": "5"}] * 4)
    data = make_data(train=[{"path": path, "type": "chat"}, {"path": instructions, "type": "instruction"}], seq_len=64)
    build_datasets(data, chat_tokenizer, seed=0)
    assert trailing_turns_warning(data, chat_tokenizer) is None


def test_what_is_trained_is_unchanged_the_trailing_turn_has_no_targets(chat_tokenizer, write_jsonl, make_data):
    path = write_jsonl("chat.jsonl", [{"messages": [*ANSWERED, THANKS]}])
    spec = {"path": path, "type": "chat"}
    train, _ = build_datasets(
        make_data(train=[spec], validation=[spec], seq_len=64, packing=False), chat_tokenizer, seed=0
    )
    item, length = train[0], int(train.row_tokens[0])
    ids, labels = item["input_ids"][:length].tolist(), item["labels"][:length].tolist()
    assert chat_tokenizer.decode(ids).endswith("5<|im_end|>\n<|im_start|>user\nThanks!<|im_end|>\n")
    targets = [i for i, label in zip(ids, labels) if label != IGNORE]
    assert chat_tokenizer.decode(targets) == "5<|im_end|>"


def test_the_runs_data_carries_the_warning(tmp_path, write_jsonl):
    """Through build_data into RunData.warnings, which run, prepare, preview and plan --data print."""
    path = write_jsonl("chat.jsonl", records() * 4)
    recipe = Recipe.model_validate(
        {
            "model": {"preset": "micro", "tokenizer": "builtin:shakespeare"},
            "data": {
                "train": [{"path": path, "type": "chat"}],
                "seq_len": 64,
                "cache_dir": str(tmp_path / "cache"),
                "template": "chatml",
                "add_special_tokens": True,
            },
            "batch": {"global_batch": 4, "micro_batch": 2},
            "train": {"steps": 2},
        }
    )
    warnings = build_data(recipe).warnings
    assert [w for w in warnings if f"12 conversations of {path} (the first at line 2) end with" in w]
