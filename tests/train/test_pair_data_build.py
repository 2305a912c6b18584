"""build_data for a preference recipe: the pair sets (PairRows, KtoRows) and the warnings about the pairs, from the
same entry point SFT's data comes from."""

from __future__ import annotations

import json

from memtrain.data.rows.pairs import KtoRows, PairRows
from memtrain.recipe.load import load_recipe_text
from memtrain.train.setup import build_data

RECIPE = """\
model: {{preset: mini, tokenizer: "builtin:shakespeare-chat"}}
data:
  train: [{{path: "{path}", type: {kind}}}]
  validation: [{{path: "builtin:preference/validation", type: preference}}]
  template: chatml
  seq_len: 64
  cache_dir: "{cache}"
train: {{steps: 4, objective: {objective}}}
batch: {{global_batch: 4, micro_batch: 2}}
"""


def test_a_dpo_recipe_builds_pairs_and_says_which_are_identical(tmp_path):
    lines = [line for line in open(_builtin("validation")) if line.strip()][:20]
    first = json.loads(lines[5])
    first["rejected"] = first["chosen"]
    lines[5] = json.dumps(first) + "\n"
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(lines))
    text = RECIPE.format(path=path, kind="preference", objective="dpo", cache=tmp_path / "cache")
    data = build_data(load_recipe_text(text, str(tmp_path / "r.yaml")).recipe)
    assert isinstance(data.train_set, PairRows) and isinstance(data.val_set, PairRows)
    assert len(data.train_set) == 19 and len(data.val_set) == 300
    assert any("(the first at line 6): the chosen and the rejected answer are the same" in w for w in data.warnings)


def test_a_kto_recipe_builds_kto_records(tmp_path):
    records = [
        {
            "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
            "completion": str(i + i % 2),
            "label": i % 2 == 0,
        }
        for i in range(8)
    ]
    path = tmp_path / "kto.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    text = RECIPE.format(path=path, kind="kto", objective="kto", cache=tmp_path / "cache").replace(
        'builtin:preference/validation", type: preference', f'{path}", type: kto'
    )
    data = build_data(load_recipe_text(text, str(tmp_path / "r.yaml")).recipe)
    assert isinstance(data.train_set, KtoRows) and len(data.train_set) == 8 and not data.warnings


def _builtin(split: str) -> str:
    from memtrain.data.read.records import resolve_dataset_path

    return str(resolve_dataset_path(f"builtin:preference/{split}"))
