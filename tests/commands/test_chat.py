"""`memtrain chat` answers as `memtrain eval` scores: the same prompt (the run's template, as training wrote it) and
the same greedy generation, from the final model, an adapter on its base, or a checkpoint."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from typer.testing import CliRunner

from memtrain.cli import app
from memtrain.commands.chat import chat_command
from memtrain.commands.run import run_command
from memtrain.train.resolve import RunOptions
from memtrain.train.score_run import evaluate_run
from tests.conftest import ROOT

BASE_MODEL = ROOT / "memtrain" / "assets" / "models" / "shakespeare-mini"
QUICKSTART = ROOT / "recipes" / "quickstart-chat.yaml"


def chat(run_dir, **options) -> str:
    out = io.StringIO()
    assert chat_command(run_dir, console=Console(file=out, width=200), **options) == 0
    return out.getvalue()


def train(tmp_path, name: str, *overrides: str):
    run_dir = tmp_path / name
    common = [
        f"model.path={BASE_MODEL}",
        f"train.output_dir={run_dir}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "train.eval_generate=0",
        "train.eval_every=100",
        "schedule.warmup_steps=2",
        # the 300 held-out conversations as training data too: quick to tokenise, and which weights answer does not
        # matter here, only that chat and eval answer alike
        "data.train=[{path: 'builtin:chat/validation', type: chat}]",
    ]
    assert run_command(QUICKSTART, [*common, *overrides], RunOptions()) == 0
    return run_dir


@pytest.mark.slow
def test_chat_answers_a_held_out_question_as_eval_scores_it(tmp_path):
    run_dir = train(tmp_path, "full", "train.steps=20", "train.save_every=20")
    scored = evaluate_run(run_dir, limit=1, keep_samples=1).generation.samples[0]
    assert scored.question == "What is the first letter of 'sound'?"  # the first held-out conversation, one turn
    answer = chat(run_dir, prompt=scored.question)
    assert answer.strip() == scored.generated
    assert chat(run_dir, prompt=scored.question, checkpoint="20") == answer  # the weights final/ was exported from
    # talking: the same answer, then a second turn on top of the first
    said = iter([scored.question, "And of 'once'?", "/exit"])
    talk = chat(run_dir, read_line=lambda _: next(said))
    assert talk.splitlines()[1] == answer.strip()


@pytest.mark.slow
def test_an_adapter_run_answers_from_its_base_and_from_its_checkpoint_alike(tmp_path):
    run_dir = train(
        tmp_path,
        "lora",
        "train.steps=6",
        "train.save_every=6",
        "model.lora={r: 8, alpha: 16, dropout: 0.0, modules_to_save: [embed_tokens, lm_head]}",
    )
    assert (run_dir / "final" / "adapter_config.json").is_file()
    question = "What is 3 + 4?"
    assert chat(run_dir, prompt=question, max_new_tokens=12) == chat(
        run_dir, prompt=question, max_new_tokens=12, checkpoint=str(run_dir / "checkpoints" / "step-000006")
    )


def test_bad_options_and_a_missing_run_are_said_with_exit_2(tmp_path):
    runner = CliRunner()
    missing = runner.invoke(app, ["chat", str(tmp_path / "nowhere"), "--prompt", "hi"])
    assert missing.exit_code == 2 and "there is no run directory" in missing.output
    hot = runner.invoke(app, ["chat", str(tmp_path), "--temperature", "-1", "--prompt", "hi"])
    assert hot.exit_code == 2 and "--temperature must be 0 or more" in hot.output
    (tmp_path / "run").mkdir()
    none = runner.invoke(app, ["chat", str(tmp_path / "run"), "--checkpoint", "5", "--prompt", "hi"])
    assert none.exit_code == 2 and "no complete checkpoint '5'" in " ".join(none.output.split())
