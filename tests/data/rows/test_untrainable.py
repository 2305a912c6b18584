"""A record with nothing to train on (no assistant message, an empty or null answer) is an error naming its line
whose hint says how to go on; `data.skip_untrainable: true` leaves such records out instead, counted and warned
about (dataset, count, first line, through the token cache), and is an error when it would leave out every record."""

from __future__ import annotations

import pytest

from memtrain.data.rows.dataset import build_datasets
from memtrain.data.rows.mixture import untrainable_records_warning
from memtrain.errors import DataError

GOOD = [
    {"messages": [{"role": "user", "content": f"What is {i} + 1?"}, {"role": "assistant", "content": str(i + 1)}]}
    for i in range(4)
]
NO_ANSWER = {"messages": [{"role": "user", "content": "Anyone there?"}]}
EMPTY_ANSWER = {"messages": [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": " "}]}


def rows(dataset) -> list[list[int]]:
    return sorted(dataset[i]["input_ids"][: int(dataset.row_tokens[i])].tolist() for i in range(len(dataset)))


@pytest.mark.parametrize("bad, key", [(NO_ANSWER, "messages"), (EMPTY_ANSWER, "messages[1].content")])
def test_by_default_a_record_without_an_answer_is_an_error_whose_hint_says_how_to_go_on(
    bad, key, chat_tokenizer, write_jsonl, make_data
):
    path = write_jsonl("chat.jsonl", [GOOD[0], bad, GOOD[1]])
    with pytest.raises(DataError) as err:
        build_datasets(make_data(train=[{"path": path, "type": "chat"}]), chat_tokenizer, seed=0)
    [problem] = err.value.problems
    assert (problem.file, problem.line, problem.key) == (path, 2, key)
    assert "remove the record" in problem.hint and "data.skip_untrainable: true leaves such records out" in problem.hint


def test_an_empty_instruction_output_is_untrainable_but_a_misnamed_field_is_not(chat_tokenizer, write_jsonl, make_data):
    path = write_jsonl(
        "alpaca.jsonl",
        [
            {"instruction": "Say hi.", "output": "hi"},
            {"instruction": "x", "output": ""},
            {"instruction": "Say hi.", "answer": "hi"},
        ],
    )
    spec = {"path": path, "type": "instruction"}
    with pytest.raises(DataError) as err:  # skipping on: the empty output is left out, the missing field is not
        build_datasets(make_data(train=[spec], skip_untrainable=True, template="chatml"), chat_tokenizer, seed=0)
    assert [(p.line, p.key) for p in err.value.problems] == [(3, "output")]
    assert "no field 'output'" in err.value.problems[0].message


def test_skip_untrainable_leaves_them_out_counts_them_and_trains_on_the_rest(chat_tokenizer, write_jsonl, make_data):
    path = write_jsonl("chat.jsonl", [GOOD[0], NO_ANSWER, GOOD[1], EMPTY_ANSWER, GOOD[2], NO_ANSWER, GOOD[3]])
    clean = write_jsonl("clean.jsonl", GOOD)
    data = make_data(
        train=[{"path": path, "type": "chat"}],
        validation=[{"path": path, "type": "chat"}],
        skip_untrainable=True,
        seq_len=64,
        packing=False,
    )
    expected, _ = build_datasets(
        make_data(
            train=[{"path": clean, "type": "chat"}],
            validation=[{"path": clean, "type": "chat"}],
            seq_len=64,
            packing=False,
        ),
        chat_tokenizer,
        seed=0,
    )
    for _ in range(2):  # tokenised, then read back from the cache with its notes
        train, validation = build_datasets(data, chat_tokenizer, seed=0)
        assert len(train) == len(validation) == 4 and rows(train) == rows(expected)
        assert train.stats.dropped_no_targets == 0  # said by the warning, not counted again as "without targets"
        warning = untrainable_records_warning(data, chat_tokenizer)
        assert warning == (
            f"data.skip_untrainable: left out 3 records of {path} (the first at line 2); 3 records of "
            f"{path} (the first at line 2) with nothing to train on (no assistant message, or an empty "
            "or null answer) — fix those records to train on them, or leave them out of the files"
        )
    assert (
        untrainable_records_warning(
            make_data(train=[{"path": clean, "type": "chat"}], skip_untrainable=True), chat_tokenizer
        )
        is None
    )


def test_skip_untrainable_with_no_record_left_is_an_error(chat_tokenizer, write_jsonl, make_data):
    path = write_jsonl("chat.jsonl", [NO_ANSWER, EMPTY_ANSWER])
    with pytest.raises(DataError) as err:
        build_datasets(make_data(train=[{"path": path, "type": "chat"}], skip_untrainable=True), chat_tokenizer, seed=0)
    [problem] = err.value.problems
    assert (problem.file, problem.key) == (path, "data.skip_untrainable")
    assert (
        problem.message.startswith("every record of the dataset (2) has nothing to train on")
        and "line 1" in problem.message
    )


def test_a_left_out_last_record_counts_no_targets_and_breaks_nothing(chat_tokenizer, write_jsonl, make_data):
    """The empty sample of a last record left out starts past the file's last token; counting its
    targets read past the end (IndexError in preview, plan --data and run alike)."""
    path = write_jsonl("ends-bad.jsonl", [*GOOD, NO_ANSWER])
    train, _ = build_datasets(
        make_data(
            train=[{"path": path, "type": "chat"}],
            skip_untrainable=True,
            validation_fraction=0.25,
            seq_len=64,
            packing=False,
        ),
        chat_tokenizer,
        seed=0,
    )
    assert len(train) == 3 and train.stats.dropped_no_targets == 0
