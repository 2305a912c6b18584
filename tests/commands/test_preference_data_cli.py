"""Preference data at the command line: `memtrain preview` shows each pair's chosen and rejected rows with the
answers marked, and bad records exit 2 naming file, line and field, with no token cache entry written."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from memtrain.cli import app

RECIPE = """\
model: {{preset: mini, tokenizer: "builtin:shakespeare-chat"}}
data:
  train: [{{path: "{path}", type: {kind}}}]
  template: chatml
  seq_len: 128
  cache_dir: cache
train: {{steps: 4, objective: {objective}}}
batch: {{global_batch: 4, micro_batch: 2}}
"""


def _recipe(tmp_path: Path, path: str, kind: str = "preference", objective: str = "dpo") -> Path:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.format(path=path, kind=kind, objective=objective))
    return recipe


def test_preview_shows_a_pairs_two_rows_with_the_answers_as_targets(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["preview", str(_recipe(tmp_path, "builtin:preference")), "--rows", "1", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["data"]["kind"] == "pairs" and summary["rows_total"] == summary["data"]["samples"]
    [row] = summary["rows"]
    chosen, rejected = row["samples"]
    assert chosen["source"] == "chosen of builtin:preference" and rejected["source"] == "rejected of builtin:preference"
    for sample in (chosen, rejected):
        targets = "".join(span["text"] for span in sample["spans"] if span["target"])
        assert targets.endswith("<|im_end|>") and "user" not in targets
    prompts = ["".join(s["text"] for s in sample["spans"] if not s["target"]) for sample in (chosen, rejected)]
    assert prompts[0] == prompts[1]


def test_bad_records_exit_2_with_file_line_and_field_and_write_no_cache_entry(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    whole = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    other = [{"role": "user", "content": "z"}, {"role": "assistant", "content": "y"}]
    lines = [
        {"prompt": "a", "chosen": "b", "rejected": "c"},
        {"prompt": "a", "rejected": "c"},
        {"chosen": whole, "rejected": other},
    ]
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = CliRunner().invoke(app, ["preview", str(_recipe(tmp_path, "bad.jsonl"))])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"{tmp_path / 'bad.jsonl'}:2: chosen: no field 'chosen'" in result.output
    assert f"{tmp_path / 'bad.jsonl'}:3: chosen: the record has no 'prompt' field" in result.output
    (tmp_path / "kto.jsonl").write_text(json.dumps({"prompt": "a", "completion": "b", "label": "yes"}) + "\n")
    result = CliRunner().invoke(app, ["preview", str(_recipe(tmp_path, "kto.jsonl", "kto", "kto"))])
    assert result.exit_code == 2 and f'{tmp_path / "kto.jsonl"}:1: label: is a string ("yes"), not true or false' in (
        result.output
    )
    assert not list((tmp_path / "cache").glob("*.npy"))
