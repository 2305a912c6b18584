"""The chat quickstart end to end on DeepSpeed's CPU accelerator: exact match rises with fine-tuning, and the
generation evaluation leaves training exactly as it was."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from memtrain.commands.eval import eval_command
from memtrain.commands.run import run_command
from memtrain.train.resolve import RunOptions
from tests.conftest import ROOT, read_records, train_losses

pytestmark = pytest.mark.slow

BASE_MODEL = ROOT / "memtrain" / "assets" / "models" / "shakespeare-mini"
CHAT = {
    "train": [{"path": "builtin:chat", "type": "chat"}],
    "validation": [{"path": "builtin:chat/validation", "type": "chat"}],
    "template": "chatml",
    "seq_len": 64,
}
# Measured on two CPU cores (recipes/quickstart-chat.yaml as shipped): exact match 0.00 at step 0 (the base has
# never seen ChatML) and 0.12-0.13 after 300 steps (12 or 13 of 100 by machine and PyTorch version; README.md says
# 0.13: first letters, word lengths, multiplication). The margin is half of that: other machines' arithmetic takes
# another path through training, and 100 answers are noisy.
MARGIN = 0.06


def test_chat_quickstart_exact_match_rises_by_a_margin(tmp_path):
    recipe = ROOT / "recipes" / "quickstart-chat.yaml"
    run_dir = tmp_path / "quickstart-chat"
    assert (
        run_command(
            recipe,
            [f"model.path={BASE_MODEL}", f"train.output_dir={run_dir}", f"data.cache_dir={tmp_path / 'cache'}"],
            RunOptions(),
        )
        == 0
    )
    scores = read_records(run_dir, "generation")
    assert [s["step"] for s in scores] == [0, 300]
    before, after = scores[0]["exact_match"], scores[-1]["exact_match"]
    assert scores[0]["total"] == scores[-1]["total"] == 100
    assert after >= before + MARGIN, (before, after, scores[-1]["by_task"])
    # `memtrain eval` on the exported model answers the same questions the same way
    out = io.StringIO()
    assert eval_command(run_dir, as_json=True, samples=3, limit=100, console=Console(file=out)) == 0
    result = json.loads(out.getvalue())
    assert result["exact_match"] == pytest.approx(after)
    evals = read_records(run_dir, "eval")
    assert result["loss"] == pytest.approx(evals[-1]["loss"], rel=1e-4)


def test_generation_evaluation_leaves_training_unchanged(write_recipe):
    """LoRA dropout draws from torch's RNG every step: an evaluation that drew from it would change the losses."""
    extra = {
        "model": {
            "preset": "mini",
            "tokenizer": "builtin:shakespeare-chat",
            "lora": {"r": 4, "alpha": 8, "dropout": 0.2},
        },
        "data": CHAT,
        "train": {"steps": 4, "eval_every": 100, "save_every": 100},
    }
    without = write_recipe("without", extra)
    with_eval = write_recipe("with", {**extra, "train": {**extra["train"], "eval_generate": 4}})
    for recipe in (without, with_eval):
        assert run_command(recipe, [], RunOptions(save=False)) == 0
    run_dirs = [recipe.parent / "runs" / name for recipe, name in ((without, "without"), (with_eval, "with"))]
    assert read_records(run_dirs[0], "generation") == []
    assert [r["step"] for r in read_records(run_dirs[1], "generation")] == [0, 4]
    assert train_losses(run_dirs[0]) == train_losses(run_dirs[1])
