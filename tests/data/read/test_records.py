"""Every dataset type from every file type, mixing weights, and bad input named by file, line (or record) and field."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from memtrain.data.read.records import read_records
from memtrain.data.rows.dataset import build_datasets
from memtrain.data.rows.overlap import HELD_OUT_KEYS_DIR
from memtrain.data.rows.weights import weighted_indices
from memtrain.errors import DataError

RECORDS = {
    "chat": [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"What is {i} + 1?"},
                {"role": "assistant", "content": str(i + 1)},
            ]
        }
        for i in range(6)
    ],
    "sharegpt": [
        {"conversations": [{"from": "human", "value": f"Reverse '{w}'."}, {"from": "gpt", "value": w[::-1]}]}
        for w in ("king", "crown", "sword", "night", "lord", "heaven")
    ],
    "completion": [{"prompt": f"What is {i} times 2?", "completion": str(2 * i)} for i in range(6)],
    "instruction": [
        {"instruction": "Write the word in capital letters.", "input": w, "output": w.upper()}
        for w in ("king", "crown", "sword", "night", "lord", "heaven")
    ],
    "text": [{"text": f"Scene {i}. Enter a lord, with attendants."} for i in range(6)],
}
TYPES = {"chat": "chat", "sharegpt": "chat", "completion": "completion", "instruction": "instruction", "text": "text"}


def write(records: list[dict], kind: str, directory: Path, name: str = "data") -> str:
    """The records as a file (or directory) of `kind`: jsonl, json, parquet or datasets."""
    if kind == "jsonl":
        path = directory / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif kind == "json":
        path = directory / f"{name}.json"
        path.write_text(json.dumps(records, indent=1))
    elif kind == "parquet":
        path = directory / f"{name}.parquet"
        # from_pylist infers the columns from the first record only: unify over all of them
        schema = pa.unify_schemas([pa.Table.from_pylist([r]).schema for r in records])
        pq.write_table(pa.Table.from_pylist(records, schema=schema), path)
    else:
        path = directory / name
        # from_list takes the columns of the first record only: give it every column
        columns = dict.fromkeys(k for r in records for k in r)
        datasets.Dataset.from_dict({k: [r.get(k) for r in records] for k in columns}).save_to_disk(str(path))
    return str(path)


def samples(data, tokenizer) -> list[list[int]]:
    train, validation = build_datasets(data, tokenizer, seed=0)
    rows = [train[i] for i in range(len(train))] + [validation[i] for i in range(len(validation))]
    return sorted(row["input_ids"][row["labels"] != -100].tolist() for row in rows)


@pytest.mark.parametrize("kind", ["json", "parquet", "datasets"])
@pytest.mark.parametrize("layout", list(RECORDS))
def test_every_layout_reads_the_same_from_every_file_type(layout, kind, chat_tokenizer, make_data, tmp_path):
    reference = write(RECORDS[layout], "jsonl", tmp_path, "reference")
    other = write(RECORDS[layout], kind, tmp_path)
    got = [
        samples(make_data(train=[{"path": p, "type": TYPES[layout]}], seq_len=32, packing=False), chat_tokenizer)
        for p in (reference, other)
    ]
    assert got[0] == got[1] and len(got[0]) == 6


def test_a_datasets_directory_with_splits(chat_tokenizer, make_data, tmp_path):
    path = tmp_path / "dict"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(RECORDS["chat"]), "test": datasets.Dataset.from_list(RECORDS["chat"][:2])}
    ).save_to_disk(str(path))
    assert [n for n, _ in read_records(str(path), "test")] == [1, 2]
    assert len(list(read_records(str(path)))) == 6  # 'train' by default
    with pytest.raises(DataError, match="no split 'dev'; its splits: train, test"):
        list(read_records(str(path), "dev"))


def test_weights_give_round_weight_times_n_samples_the_same_for_a_seed():
    assert len(weighted_indices(10, 0.5, seed=1, dataset=0)) == 5
    assert np.array_equal(weighted_indices(10, 0.5, 1, 0), weighted_indices(10, 0.5, 1, 0))
    assert not np.array_equal(weighted_indices(100, 0.5, 1, 0), weighted_indices(100, 0.5, 2, 0))
    repeated = weighted_indices(10, 2.5, seed=1, dataset=0)
    assert len(repeated) == 25
    counts = np.bincount(repeated, minlength=10)
    assert set(counts.tolist()) == {2, 3} and (counts == 3).sum() == 5
    assert weighted_indices(10, 1.0, 1, 0).tolist() == list(range(10))


def test_mixed_datasets_follow_their_weights_deterministically(chat_tokenizer, make_data, tmp_path):
    chat = write(RECORDS["chat"] * 10, "jsonl", tmp_path, "chat")  # 60 records
    words = write(RECORDS["instruction"] * 10, "parquet", tmp_path, "words")  # 60 records
    spec = [{"path": chat, "type": "chat", "weight": 0.5}, {"path": words, "type": "instruction", "weight": 2}]
    data = make_data(train=spec, template="chatml", seq_len=64, validation_fraction=0.1)
    train, validation = build_datasets(data, chat_tokenizer, seed=5)
    assert train.stats.samples == round(0.5 * 54) + 2 * 54  # weights apply after the 10 % tail is held out
    assert validation.stats.samples == 12
    again, _ = build_datasets(data, chat_tokenizer, seed=5)
    for i in range(len(train)):
        assert all(np.array_equal(train[i][k], again[i][k]) for k in train[i])
    other, _ = build_datasets(data, chat_tokenizer, seed=6)
    assert any(not np.array_equal(train[i]["input_ids"], other[i]["input_ids"]) for i in range(len(train)))


def test_a_text_dataset_is_cut_into_seq_len_pieces(text_tokenizer, make_data, tmp_path):
    long = "Now is the winter of our discontent made glorious summer by this sun of York. " * 20
    path = write([{"text": long}], "jsonl", tmp_path)
    spec = {"path": path, "type": "text"}
    train, _ = build_datasets(
        make_data(train=[spec], validation=[spec], seq_len=32, packing=False), text_tokenizer, seed=0
    )
    n_tokens = len(text_tokenizer(long, add_special_tokens=False)["input_ids"]) + 1  # with its eos
    assert train.n_tokens == n_tokens and len(train) == -(-n_tokens // 32)


# ---------------------------------------------------------------- bad input


def problems_of(data, tokenizer):
    with pytest.raises(DataError) as err:
        build_datasets(data, tokenizer, seed=0)
    return err.value.problems


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.mark.parametrize(
    "bad, key, words",
    [
        (
            {"messages": [{"role": "narrator", "content": "hi"}, {"role": "assistant", "content": "x"}]},
            "messages[0].role",
            "unknown role 'narrator'",
        ),
        ({"messages": [{"role": "user", "content": "hi"}]}, "messages", "no assistant turn"),
        (
            {"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "x"}]},
            "messages[0].content",
            "is empty",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 7}]},
            "messages[1].content",
            "is a whole number, not a string",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]},
            "messages[1].content",
            "is null",
        ),
        (
            {"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]},
            "messages[0].content",
            "no 'content'",
        ),
        ({"messages": []}, "messages", "empty list"),
        ({"turns": []}, "messages", "no field 'messages' or 'conversations'"),
    ],
)
def test_bad_chat_records_name_file_line_and_field(bad, key, words, chat_tokenizer, write_jsonl, make_data):
    path = write_jsonl("bad.jsonl", [GOOD, bad, GOOD])
    problems = problems_of(make_data(train=[{"path": path, "type": "chat"}]), chat_tokenizer)
    assert len(problems) == 1
    assert (problems[0].file, problems[0].line, problems[0].key) == (path, 2, key)
    assert words in problems[0].message


def test_malformed_lines_and_missing_fields_are_reported_together(chat_tokenizer, write_jsonl, make_data):
    ok = {"instruction": "Say hi.", "output": "hi"}
    path = write_jsonl("bad.jsonl", [ok, '{"instruction": "x", ', ok, {"instruction": "Say hi."}, "[1, 2]", ok])
    problems = problems_of(make_data(train=[{"path": path, "type": "instruction"}], template="chatml"), chat_tokenizer)
    assert [(p.line, p.key) for p in problems] == [(2, ""), (4, "output"), (5, "")]
    assert "invalid JSON" in problems[0].message and "no field 'output'" in problems[1].message
    assert "not an object" in problems[2].message
    assert all(p.file == path for p in problems)


def test_past_ten_problems_the_first_ten_in_file_order_and_a_count_of_the_rest(chat_tokenizer, write_jsonl, make_data):
    """A bad JSON line early in the file comes first, although the reader reports it only at the end, and the
    problems past the tenth are counted rather than silently dropped."""
    lines = [GOOD, GOOD, '{"messages": [', *[GOOD] * 20, *[{"turns": []}] * 12, GOOD]  # line 3; lines 24-35
    path = write_jsonl("bad.jsonl", lines)
    with pytest.raises(DataError) as err:
        build_datasets(make_data(train=[{"path": path, "type": "chat"}]), chat_tokenizer, seed=0)
    problems = err.value.problems
    assert [p.line for p in problems[:10]] == [3, *range(24, 33)]
    assert "invalid JSON" in problems[0].message
    assert problems[10].message == "… and 3 more problems in this file" and problems[10].file == path
    assert len(problems) == 11
    assert err.value.count == "13 problems, the first 10 listed"  # the headline said "11 problems"


def test_instruction_records_read_as_chat_say_which_type_they_are(chat_tokenizer, write_jsonl, make_data):
    path = write_jsonl("alpaca.jsonl", [{"instruction": "Add 1 and 2.", "input": "", "output": "3"}])
    [problem] = problems_of(make_data(train=[{"path": path, "type": "chat"}]), chat_tokenizer)
    assert problem.message == "no field 'messages' or 'conversations'; fields here: instruction, input, output"
    assert problem.hint == "these look like instruction records: set the dataset's type: instruction"


def test_a_text_jsonl_with_many_bad_lines_counts_those_past_the_tenth(text_tokenizer, write_jsonl, make_data):
    path = write_jsonl("text.jsonl", [{"text": "Enter a lord."}, *[{"body": "x"}] * 14])
    problems = problems_of(make_data(train=[{"path": path, "type": "text"}]), text_tokenizer)
    assert [p.line for p in problems[:10]] == list(range(2, 12))
    assert problems[-1].message == "… and 4 more problems in this file"


@pytest.mark.parametrize("kind", ["json", "parquet", "datasets"])
def test_bad_records_in_other_file_types_name_the_record(kind, chat_tokenizer, make_data, tmp_path):
    records = [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": ""}]
    path = write(records, kind, tmp_path)
    problems = problems_of(make_data(train=[{"path": path, "type": "completion"}]), chat_tokenizer)
    assert [(p.file, p.line, p.key) for p in problems] == [(path, 2, "completion")]


def test_a_template_that_cannot_render_a_record_names_it(text_tokenizer, write_jsonl, make_data):
    bad = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "system", "content": "late"},
            {"role": "assistant", "content": "x"},
        ]
    }
    path = write_jsonl("bad.jsonl", [GOOD, bad])
    problems = problems_of(make_data(train=[{"path": path, "type": "chat"}], template="alpaca"), text_tokenizer)
    assert [(p.file, p.line, p.key) for p in problems] == [(path, 2, "data.template")]
    assert "system message only as the first" in problems[0].message


def test_samples_with_no_target_left_are_dropped_and_counted(chat_tokenizer, write_jsonl, make_data):
    long_prompt = {"messages": [{"role": "user", "content": "word " * 40}, {"role": "assistant", "content": "ok"}]}
    path = write_jsonl("chat.jsonl", [GOOD] * 4 + [long_prompt])
    spec = {"path": path, "type": "chat"}
    train, _ = build_datasets(make_data(train=[spec], validation=[spec], seq_len=24), chat_tokenizer, seed=0)
    assert train.stats.dropped_no_targets == 1 and train.stats.samples == 4
    dropped, _ = build_datasets(
        make_data(train=[spec], validation=[spec], seq_len=24, truncation="drop"), chat_tokenizer, seed=0
    )
    assert dropped.stats.dropped_too_long == 1 and dropped.stats.samples == 4


def test_when_every_sample_is_dropped_the_error_says_why(chat_tokenizer, write_jsonl, make_data):
    long_prompt = {"messages": [{"role": "user", "content": "word " * 40}, {"role": "assistant", "content": "ok"}]}
    path = write_jsonl("chat.jsonl", [long_prompt] * 3)
    problems = problems_of(make_data(train=[{"path": path, "type": "chat"}], seq_len=24), chat_tokenizer)
    assert problems[0].file == path and "3 without a target token within their first 24 tokens" in problems[0].message
    assert "truncation: drop" not in problems[0].message and "truncation: truncate" not in problems[0].hint
    [dropped] = problems_of(
        make_data(train=[{"path": path, "type": "chat"}], seq_len=24, truncation="drop"), chat_tokenizer
    )
    assert "3 longer than 24 tokens (truncation: drop)" in dropped.message and "truncation: truncate" in dropped.hint


def test_a_weight_that_gives_a_dataset_no_sample_is_refused_at_its_key(chat_tokenizer, write_jsonl, make_data):
    """round(0.01 × 8) = 0 left the dataset out of the mixture without a word."""
    tiny = write_jsonl("tiny.jsonl", [GOOD] * 8)
    other = write_jsonl("other.jsonl", [GOOD] * 20)
    [problem] = problems_of(
        make_data(train=[{"path": other, "type": "chat"}, {"path": tiny, "type": "chat", "weight": 0.01}]),
        chat_tokenizer,
    )
    assert problem.key == "data.train.1.weight" and problem.file == tiny
    assert "= 0 samples: this dataset would take no part in training" in problem.message


def test_nothing_is_cached_when_the_data_is_bad(chat_tokenizer, write_jsonl, make_data, tmp_path):
    path = write_jsonl("bad.jsonl", [GOOD, {"messages": [{"role": "user", "content": "hi"}]}])
    data = make_data(train=[{"path": path, "type": "chat"}], cache_dir=str(tmp_path / "cache"))
    problems_of(data, chat_tokenizer)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_the_cache_is_reused_and_keyed_by_the_target_policy(chat_tokenizer, write_jsonl, make_data, tmp_path):
    path = write_jsonl("chat.jsonl", [GOOD] * 8)
    cache = tmp_path / "cache"
    build_datasets(make_data(train=[{"path": path, "type": "chat"}], cache_dir=str(cache)), chat_tokenizer, seed=0)
    entries = sorted(p.name for p in cache.iterdir())
    # the token cache's three files and their checksums (cache.py), and the held-out keys beside them (overlap.py),
    # which no target policy changes
    assert len(entries) == 5 and HELD_OUT_KEYS_DIR in entries and not [n for n in entries if n.endswith(".tmp")]
    assert len([n for n in entries if n.endswith(".npy")]) == 3
    build_datasets(
        make_data(train=[{"path": path, "type": "chat"}], cache_dir=str(cache), seq_len=64, packing=False),
        chat_tokenizer,
        seed=1,
    )
    assert sorted(p.name for p in cache.iterdir()) == entries  # seq_len, packing, seed: no new entry
    build_datasets(
        make_data(train=[{"path": path, "type": "chat"}], cache_dir=str(cache), train_on_inputs=True),
        chat_tokenizer,
        seed=0,
    )
    assert len(list(cache.iterdir())) == 9  # a second entry's three files and checksums


def test_a_missing_file_and_an_unknown_format_say_what_to_do(chat_tokenizer, make_data, tmp_path):
    problems = problems_of(make_data(train=[{"path": str(tmp_path / "nope.jsonl"), "type": "chat"}]), chat_tokenizer)
    assert "cannot read" in problems[0].message and problems[0].file.endswith("nope.jsonl")
    odd = tmp_path / "data.xml"
    odd.write_text("<x/>")
    problems = problems_of(make_data(train=[{"path": str(odd), "type": "chat"}]), chat_tokenizer)
    assert "cannot tell the format" in problems[0].message and ".parquet" in problems[0].hint


@pytest.mark.parametrize("kind", ["parquet", "datasets"])
def test_a_columnar_file_mixing_both_chat_layouts(kind, chat_tokenizer, make_data, tmp_path):
    """Columnar files give every record every column (None where it has none): detection must look at values."""
    path = write(RECORDS["chat"][:3] + RECORDS["sharegpt"][:3], kind, tmp_path)
    reference = write(RECORDS["chat"][:3] + RECORDS["sharegpt"][:3], "jsonl", tmp_path, "reference")
    got = [
        samples(make_data(train=[{"path": p, "type": "chat"}], seq_len=32, packing=False), chat_tokenizer)
        for p in (reference, path)
    ]
    assert got[0] == got[1] and len(got[0]) == 6


def test_llama_factory_system_prompts_optional_or_empty_become_a_system_message_or_none():
    """system_field was required in every instruction record (a missing key, or parquet's null,
    failed the dataset) and ignored on chat data (LLaMA-Factory's sharegpt 'system' column was dropped silently);
    an empty system message in a chat record failed it."""
    from memtrain.data.read.conversation import to_conversation
    from memtrain.recipe.schema import DatasetSpec

    instruction = DatasetSpec(path="x.jsonl", type="instruction", system_field="system")
    answer = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]
    for record in (
        {"instruction": "Say hi.", "output": "hi"},
        {"instruction": "Say hi.", "output": "hi", "system": None},
        {"instruction": "Say hi.", "output": "hi", "system": " "},
    ):
        assert to_conversation(record, instruction, "x.jsonl", 1) == answer
    system = {"instruction": "Say hi.", "output": "hi", "system": "Be brief."}
    assert to_conversation(system, instruction, "x.jsonl", 1) == [{"role": "system", "content": "Be brief."}, *answer]
    chat = DatasetSpec(path="x.jsonl", type="chat", system_field="system")
    turns = [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "hi"}]
    pirate = [{"role": "system", "content": "You are a pirate."}, *answer]
    assert to_conversation({"system": "You are a pirate.", "conversations": turns}, chat, "x.jsonl", 1) == pirate
    own = [{"from": "system", "value": "You are a pirate."}, *turns]
    assert to_conversation({"system": "Ignored.", "conversations": own}, chat, "x.jsonl", 1) == pirate
    empty = [{"from": "system", "value": ""}, *turns]
    assert to_conversation({"conversations": empty}, DatasetSpec(path="x.jsonl", type="chat"), "x.jsonl", 1) == answer


def test_a_missing_field_names_the_setting_to_change_and_a_close_field():
    """Every missing field's hint said '(e.g. prompt_field)'; a typo'd 'ouptut' was not pointed at."""
    from memtrain.data.read.conversation import to_conversation
    from memtrain.recipe.schema import DatasetSpec

    with pytest.raises(DataError) as caught:
        to_conversation(
            {"instruction": "a", "ouptut": "b"}, DatasetSpec(path="x.jsonl", type="instruction"), "x.jsonl", 3
        )
    [problem] = caught.value.problems
    assert problem.key == "output" and problem.hint == "set the dataset's output_field: ouptut if that field holds it"
    with pytest.raises(DataError) as caught:
        to_conversation({"q": "a", "a": "b"}, DatasetSpec(path="x.jsonl", type="completion"), "x.jsonl", 3)
    assert caught.value.problems[0].hint == "set the dataset's prompt_field to the field that holds it"
    with pytest.raises(DataError) as caught:
        to_conversation(
            {"messages": [{"role": "chatgpt", "content": "x"}]}, DatasetSpec(path="x.jsonl", type="chat"), "x.jsonl", 3
        )
    assert "{chatgpt: assistant} for a role that answers" in caught.value.problems[0].hint
