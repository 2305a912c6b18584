"""`memtrain preview`: the rows a run trains on, built as the run builds them, with the loss's targets marked —
for chat data exactly the answers and their end-of-turn token, whatever the packing."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from memtrain.cli import app

CHAT_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "quickstart-chat.yaml"
TEXT_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"
CONVERSATIONS = [
    ("What is the capital of France?", "Paris"),
    ("Say it with a party popper.", "Done 🎉 ünïcödé"),
    ("Spell 'king' backwards.", "gnik"),
]


def _chat_file(tmp_path: Path) -> Path:
    path = tmp_path / "chat.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": question},
                        {"role": "assistant", "content": answer},
                    ]
                }
            )
            + "\n"
            for question, answer in CONVERSATIONS
        )
    )
    return path


def _preview(recipe: Path, *args: str):
    return CliRunner().invoke(app, ["preview", str(recipe), *args])


def _chat_overrides(tmp_path: Path, monkeypatch) -> list[str]:
    monkeypatch.setenv("MEMTRAIN_CACHE", str(tmp_path / "cache"))
    data = _chat_file(tmp_path)
    return [
        f"data.train=[{{path: {data}, type: chat}}]",
        f"data.validation=[{{path: {data}, type: chat}}]",
        "batch.global_batch=1",
        "batch.micro_batch=1",
    ]


def test_the_targets_of_a_packed_chat_row_are_the_answers_and_their_end_of_turn_token(tmp_path, monkeypatch):
    result = _preview(CHAT_RECIPE, *_chat_overrides(tmp_path, monkeypatch), "--json")
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert shown["rows_total"] == 1 and shown["data"]["samples"] == 3
    [row] = shown["rows"]
    assert len(row["samples"]) == 3  # all three conversations packed into the one row of 128 tokens
    answers = {answer for _, answer in CONVERSATIONS}
    for sample in row["samples"]:
        targets = "".join(span["text"] for span in sample["spans"] if span["target"])
        context = "".join(span["text"] for span in sample["spans"] if not span["target"])
        assert targets.endswith("<|im_end|>") and targets.removesuffix("<|im_end|>") in answers
        assert "<|im_start|>system\nBe brief.<|im_end|>" in context and "<|im_start|>assistant\n" in context
        assert sample["source"] == str(tmp_path / "chat.jsonl")
        assert sample["target_tokens"] == sum(len(s["token_ids"]) for s in sample["spans"] if s["target"])
    assert row["tokens"] + row["padding_tokens"] == 128
    assert row["target_tokens"] == shown["data"]["target_tokens"]  # the row holds all the data's targets


def test_the_table_marks_targets_where_there_is_no_colour(tmp_path, monkeypatch):
    result = _preview(CHAT_RECIPE, *_chat_overrides(tmp_path, monkeypatch), "--split", "validation")
    assert result.exit_code == 0, result.output
    assert "⟦Paris<|im_end|>⟧↵" in result.output and "⟦Done 🎉 ünïcödé<|im_end|>⟧" in result.output
    assert "<|im_start|>user↵\nWhat is the capital of France?<|im_end|>↵" in result.output  # context, unmarked
    assert "row 0 of 1: 3 samples" in result.output and "attend only to themselves" in result.output


def test_a_text_window_trains_on_every_token_but_its_first(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMTRAIN_CACHE", str(tmp_path / "cache"))
    result = _preview(TEXT_RECIPE, "--json", "--rows", "2", "--start", "5")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["rows"]
    assert [row["index"] for row in rows] == [5, 6]
    for row in rows:
        [sample] = row["samples"]
        assert sample["source"] is None and row["tokens"] == 128 and row["target_tokens"] == 127
        assert [span["target"] for span in sample["spans"]] == [False, True]


def test_rows_out_of_range_and_an_unknown_split_exit_2_with_the_way_out(tmp_path, monkeypatch):
    overrides = _chat_overrides(tmp_path, monkeypatch)
    past = _preview(CHAT_RECIPE, *overrides, "--start", "1")
    assert past.exit_code == 2 and "--start 1 is past the last row of the train data (1 rows)" in past.output
    assert "Traceback" not in past.output
    split = _preview(CHAT_RECIPE, *overrides, "--split", "test")
    assert split.exit_code == 2 and "--split: must be train or validation, not 'test'" in split.output


def test_a_template_that_closes_no_turn_is_warned_about_where_the_data_is_built(tmp_path, monkeypatch):
    """The tokenizer's own template writes no special token after an answer: nothing to learn to stop at. preview
    (and prepare and run, which build the data the same way) say so, at model.tokenizer."""
    from tests.data.render.test_templates import family_tokenizer

    plain = tmp_path / "plain-tokenizer"
    family_tokenizer("plain").save_pretrained(plain)
    overrides = _chat_overrides(tmp_path, monkeypatch)
    result = _preview(CHAT_RECIPE, *overrides, f"model.tokenizer={plain}", "data.template=null")
    assert result.exit_code == 0, result.output
    assert (
        "model.tokenizer: the tokenizer's chat_template (data.template is not set) writes no special token"
        in " ".join(result.output.split())
    )
    chatml = _preview(CHAT_RECIPE, *overrides)
    assert "writes no special token" not in chatml.output


def test_json_samples_carry_their_file_and_line(tmp_path, monkeypatch):
    """Each packed sample names the line of its record (a blank line first: lines, not positions), so a row that
    looks wrong can be traced to the record behind it."""
    overrides = _chat_overrides(tmp_path, monkeypatch)
    data = tmp_path / "chat.jsonl"
    data.write_text("\n" + data.read_text())
    result = _preview(CHAT_RECIPE, *overrides, "--json")
    assert result.exit_code == 0, result.output
    [row] = json.loads(result.stdout)["rows"]
    seen = {}
    for sample in row["samples"]:
        question = next(q for q, _ in CONVERSATIONS if any(q in span["text"] for span in sample["spans"]))
        seen[question] = (sample["source"], sample["line"])
    assert seen == {q: (str(data), line) for line, (q, _) in enumerate(CONVERSATIONS, start=2)}
    table = _preview(CHAT_RECIPE, *overrides)
    assert f"from {data}:2" in " ".join(table.output.split())
