"""`memtrain validate --data`: the data read as a run reads it, a bad record said at file:line with exit 2 and no
traceback (plain `validate` checks the recipe alone and passes it)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from memtrain.cli import app

CHAT_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "quickstart-chat.yaml"


def _validate(*args: str):
    return CliRunner().invoke(app, ["validate", str(CHAT_RECIPE), *args])


def _chat_file(tmp_path: Path, records: list) -> Path:
    path = tmp_path / "chat.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _good(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": str(i)}]}


def test_a_bad_record_is_said_at_its_line_with_exit_2(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMTRAIN_CACHE", str(tmp_path / "cache"))
    bad = {"messages": [{"role": "user", "content": "Hi"}, {"role": "robot", "content": "Hello"}]}
    data = _chat_file(tmp_path, [_good(i) for i in range(8)] + [bad])
    overrides = [f"data.train=[{{path: {data}, type: chat}}]", "data.validation=null"]
    assert _validate(*overrides).exit_code == 0  # the recipe alone is fine
    result = _validate(*overrides, "--data")
    said = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert f"{data}:9" in said and "messages[1].role" in said and "unknown role 'robot'" in said
    assert "Traceback" not in result.output


def test_good_data_says_what_it_became(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMTRAIN_CACHE", str(tmp_path / "cache"))
    data = _chat_file(tmp_path, [_good(i) for i in range(40)])
    overrides = [
        f"data.train=[{{path: {data}, type: chat}}]",
        "data.validation=null",
        "batch.global_batch=4",
        "batch.micro_batch=4",
    ]
    result = _validate(*overrides, "--data")
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "is a valid recipe" in said and "its data reads: 38 samples in" in said
    assert (tmp_path / "cache").is_dir()  # tokenised into the cache the run reads
    as_json = _validate(*overrides, "--data", "--json")
    assert as_json.exit_code == 0 and json.loads(as_json.stdout)["data"]["train"][0]["path"] == str(data)
