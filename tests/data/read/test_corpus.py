"""Reading documents: text and JSONL, plain and gzipped, the builtin corpus, and errors that name file and line."""

from __future__ import annotations

import gzip
import json

import pytest

from memtrain.data.read.corpus import read_documents, resolve_format, source_fingerprint
from memtrain.errors import DataError, UserError


def write_jsonl(path, records, opener=open):
    with opener(path, "wt", encoding="utf-8") as handle:
        for record in records:
            handle.write(record if isinstance(record, str) else json.dumps(record))
            handle.write("\n")
    return str(path)


def only_problem(excinfo):
    assert len(excinfo.value.problems) == 1, excinfo.value
    return excinfo.value.problems[0]


def test_text_file_is_one_document(tmp_path):
    text = "To be, or not to be.\n\nThat is the question.\n"
    path = tmp_path / "play.txt"
    path.write_text(text, encoding="utf-8")
    assert list(read_documents(str(path))) == [text]


def test_gzipped_text_and_byte_order_mark(tmp_path):
    path = tmp_path / "play.txt.gz"
    with gzip.open(path, "wb") as handle:
        handle.write(b"\xef\xbb\xbfWhat's in a name?\n")
    assert list(read_documents(str(path))) == ["What's in a name?\n"]


def test_jsonl_one_document_per_line_skipping_blank_lines(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "first"}, "", {"text": "second", "id": 2}, {"text": ""}])
    assert list(read_documents(path)) == ["first", "second"]


def test_jsonl_gz_with_another_field(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl.gz", [{"body": "ünïcode ✓"}, {"body": "b"}], opener=gzip.open)
    assert list(read_documents(path, field="body")) == ["ünïcode ✓", "b"]


def test_explicit_format_overrides_extension(tmp_path):
    path = write_jsonl(tmp_path / "d.txt", [{"text": "a"}, {"text": "b"}])
    assert list(read_documents(path, fmt="jsonl")) == ["a", "b"]
    assert list(read_documents(path, fmt="text")) == ['{"text": "a"}\n{"text": "b"}\n']
    assert resolve_format("x.NDJSON.gz") == "jsonl"
    assert resolve_format("x.md") == "text"


def test_builtin_corpus_splits():
    [train] = read_documents("builtin:shakespeare")
    [validation] = read_documents("builtin:shakespeare/validation")
    assert 900_000 < len(train) < 1_200_000  # SOURCE.md: about 1.0 MB of plays
    assert "HAMLET" in train and "HAMLET" not in validation
    assert "MALVOLIO" in validation  # Twelfth Night is held out


def test_unknown_builtin_lists_the_known_ones():
    with pytest.raises(DataError) as excinfo:
        list(read_documents("builtin:milton"))
    problem = only_problem(excinfo)
    assert "milton" in problem.message and "builtin:shakespeare/validation" in problem.hint


def test_missing_file_and_directory_are_unreadable(tmp_path):
    for spec in (str(tmp_path / "nope.jsonl"), str(tmp_path)):
        with pytest.raises(DataError) as excinfo:
            list(read_documents(spec))
        problem = only_problem(excinfo)
        assert problem.file == spec and problem.message.startswith("cannot read")


def test_damaged_gzip_is_unreadable(tmp_path):
    path = tmp_path / "bad.txt.gz"
    whole = gzip.compress(" ".join(str(i * i) for i in range(5000)).encode())
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DataError, match="cannot read"):
        list(read_documents(str(path)))


@pytest.mark.parametrize("content", ["", "  \n\n\t"])
def test_empty_text_file(tmp_path, content):
    path = tmp_path / "empty.txt"
    path.write_text(content)
    with pytest.raises(DataError, match="has no text"):
        list(read_documents(str(path)))


def test_text_that_is_not_utf8_names_its_line(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("line one\nline two\ncaf\xe9\n".encode("latin-1"))
    with pytest.raises(DataError) as excinfo:
        list(read_documents(str(path)))
    assert only_problem(excinfo).line == 3


def test_invalid_json_names_its_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, {"text": "b"}, '{"text": "c"'])
    with pytest.raises(DataError) as excinfo:
        list(read_documents(path))
    problem = only_problem(excinfo)
    assert (problem.file, problem.line) == (path, 3)
    assert "invalid JSON" in problem.message


def test_missing_field_lists_the_fields_there(tmp_path):
    records = [{"text": f"doc {i}"} for i in range(11)] + [{"prompt": "p", "answer": "a"}]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    with pytest.raises(DataError) as excinfo:
        list(read_documents(path))
    problem = only_problem(excinfo)
    assert problem.line == 12
    assert problem.message == "line 12 has no field 'text'; fields there: prompt, answer"
    assert "data.field" in problem.hint


def test_non_string_field_and_non_object_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "ok"}, {"text": 42}, "[1, 2]", {"text": None}])
    with pytest.raises(DataError) as excinfo:
        list(read_documents(path))
    problems = excinfo.value.problems
    assert [p.line for p in problems] == [2, 3, 4]  # collected together, not one at a time
    assert "is a whole number, not a string" in problems[0].message
    assert "holds a list, not an object" in problems[1].message
    assert "is null, not a string" in problems[2].message


def test_jsonl_without_any_text(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": ""}, ""])
    with pytest.raises(DataError, match="no documents with text in field 'text'"):
        list(read_documents(path))


def test_problems_format_with_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["not json"])
    with pytest.raises(UserError) as excinfo:
        list(read_documents(path))
    assert str(excinfo.value).startswith(f"{path}:1: invalid JSON")


def test_fingerprint_follows_content_format_and_field(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "x", "body": "y"}])
    copy = write_jsonl(tmp_path / "copy.jsonl", [{"text": "x", "body": "y"}])
    other = write_jsonl(tmp_path / "other.jsonl", [{"text": "z", "body": "y"}])
    base = source_fingerprint(a, "auto", "text")
    assert source_fingerprint(copy, "auto", "text") == base  # the content, not the path
    assert source_fingerprint(a, "jsonl", "text") == base  # auto resolves to jsonl
    assert (
        len(
            {
                base,
                source_fingerprint(other, "auto", "text"),
                source_fingerprint(a, "auto", "body"),
                source_fingerprint(a, "text", "text"),
            }
        )
        == 4
    )


def test_damaged_jsonl_gzip_names_the_line_it_stopped_at(tmp_path):
    whole = gzip.compress("".join(json.dumps({"text": f"line {i} " * 20}) + "\n" for i in range(3000)).encode())
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(whole[: len(whole) // 2])
    documents = []
    with pytest.raises(DataError) as excinfo:
        documents.extend(read_documents(str(path)))
    problem = only_problem(excinfo)
    assert "cannot read past line" in problem.message
    assert len(documents) >= 1 and problem.line >= len(documents) + 1
