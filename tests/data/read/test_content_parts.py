"""A message's content as a list of parts (OpenAI's [{"type": "text", "text": ...}]): text parts train as one text,
joined as an OpenAI-compatible server joins them; a part a text model cannot read is refused at file:line with the
part's index, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memtrain.cli import app
from memtrain.data.read.conversation import PART_SEPARATOR, to_conversation
from memtrain.errors import DataError
from memtrain.recipe.schema import DatasetSpec

CHAT = DatasetSpec(path="x.jsonl", type="chat")
CHAT_RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "quickstart-chat.yaml"


def parts(*texts: str) -> list[dict]:
    return [{"type": "text", "text": text} for text in texts]


def test_text_parts_read_as_the_string_they_join_to():
    record = {
        "messages": [
            {"role": "system", "content": parts("Be brief.")},
            {"role": "user", "content": parts("Spell 'king'", "backwards.")},
            {"role": "assistant", "content": parts("gnik")},
        ]
    }
    as_parts = to_conversation(record, CHAT, "x.jsonl", 1)
    assert [m["content"] for m in as_parts] == ["Be brief.", "Spell 'king'\nbackwards.", "gnik"]
    joined = {
        "messages": [{**m, "content": PART_SEPARATOR.join(p["text"] for p in m["content"])} for m in record["messages"]]
    }
    assert as_parts == to_conversation(joined, CHAT, "x.jsonl", 1)


def test_sharegpt_values_may_be_parts_too():
    record = {"conversations": [{"from": "human", "value": parts("Hi")}, {"from": "gpt", "value": parts("Hello", "!")}]}
    assert [m["content"] for m in to_conversation(record, CHAT, "x.jsonl", 1)] == ["Hi", "Hello\n!"]


@pytest.mark.parametrize(
    ("content", "key", "message"),
    [
        (
            [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "x.png"}}],
            "messages[0].content[1]",
            "is a 'image_url' part; only text parts can be trained on",
        ),
        ([{"text": "no type"}], "messages[0].content[0]", "is an object without a type"),
        (["bare string"], "messages[0].content[0]", "is a string without a type"),
        ([{"type": "text", "text": 3}], "messages[0].content[0].text", "is a whole number, not a string"),
    ],
)
def test_a_part_that_is_not_text_is_refused_with_its_index(content, key, message):
    record = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "A cat."}]}
    with pytest.raises(DataError) as caught:
        to_conversation(record, CHAT, "x.jsonl", 7)
    [problem] = caught.value.problems
    assert (problem.file, problem.line, problem.key) == ("x.jsonl", 7, key)
    assert message in problem.message


def test_an_answer_of_no_parts_is_untrainable_as_an_empty_answer_is():
    record = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": []}]}
    with pytest.raises(DataError, match="is empty"):
        to_conversation(record, CHAT, "x.jsonl", 1)


def test_an_image_part_stops_the_cli_at_file_line_with_exit_2(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMTRAIN_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "chat.jsonl"
    good = {"messages": [{"role": "user", "content": parts("Hi")}, {"role": "assistant", "content": parts("Hello")}]}
    image = {"type": "image_url", "image_url": {"url": "cat.png"}}
    bad = {"messages": [{"role": "user", "content": [*parts("What is it?"), image]}, good["messages"][1]]}
    data.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    result = CliRunner().invoke(
        app, ["preview", str(CHAT_RECIPE), f"data.train=[{{path: {data}, type: chat}}]", "data.validation=null"]
    )
    output = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert f"{data}:2" in output and "messages[0].content[1]" in output and "'image_url' part" in output
    assert "Traceback" not in result.output
