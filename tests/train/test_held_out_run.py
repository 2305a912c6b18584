"""A chat run whose held-out questions are also in its training data, end to end on the CPU (real DeepSpeed): the
start record and the start line count them, the exact match says them, a validation loss stands beside the step-0
exact match, and the bar's last loss is the last step's, not the last flushed one's (step 25's at 30/30 once)."""

from __future__ import annotations

import json
import re

import pytest

from memtrain.commands.run import run_command
from tests.conftest import read_records

pytestmark = pytest.mark.slow

WORDS = ("king", "crown", "sword", "night", "lord", "heaven")


def test_a_run_on_repeated_records_says_its_held_out_prompts_were_trained_on(write_recipe, tmp_path, capsys):
    data = tmp_path / "repeated.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {"conversations": [{"from": "human", "value": f"Reverse '{w}'."}, {"from": "gpt", "value": w[::-1]}]}
            )
            + "\n"
            for w in (WORDS[i % 6] for i in range(40))
        )
    )
    recipe = write_recipe(
        "repeated",
        {
            "model": {"preset": "mini", "tokenizer": "builtin:shakespeare-chat"},
            "data": {
                "train": [{"path": str(data), "type": "chat"}],
                "validation": None,
                "template": "chatml",
                "seq_len": 32,
                "packing": False,
            },
            "batch": {"global_batch": 2, "micro_batch": 2},
            "train": {"steps": 6, "eval_every": 100, "save_every": 100, "log_every": 4, "eval_generate": 2},
        },
    )
    assert run_command(recipe, []) == 0
    err = capsys.readouterr().err
    run_dir = tmp_path / "runs" / "repeated"
    start = read_records(run_dir, "run")[0]
    held_out = {"samples": 2, "prompts_in_train": 2, "answers_in_train": 2, "dropped": 0}
    assert start["data"]["held_out"] == held_out
    said = " ".join(err.split())
    assert "held-out: 2 of 2 prompts also in training (2 with the same answer)" in said  # the start line
    assert "2 of 2 held-out prompts also occur in the training data" in said  # the warning
    generation = read_records(run_dir, "generation")
    assert [(g["step"], g["prompts_in_train"], g["answers_in_train"]) for g in generation] == [(0, 2, 2), (6, 2, 2)]
    assert re.search(r"step 0: exact match \d\.\d{3} \(\d/2 held-out answers, 2 of them also in training\)", said)
    # a validation loss before training beside the step-0 exact match, and at the end
    assert [e["step"] for e in read_records(run_dir, "eval")] == [0, 6]
    assert "step 0: validation loss" in said
    # the bar's last loss is step 6's (log_every 4 flushed step 4's last)
    losses = {r["step"]: r["loss"] for r in read_records(run_dir, "train")}
    assert f"{losses[6]:.3f}" != f"{losses[4]:.3f}"
    shown = re.findall(r"6/6 loss (\d+\.\d{3})", said)
    assert shown and shown[-1] == f"{losses[6]:.3f}", (shown, losses[4], losses[6])
