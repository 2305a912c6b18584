"""`memtrain eval RUN_DIR`: the JSON it prints and the inputs it refuses, on a run directory made by hand
(a random mini Llama saved as final/, and the run.json a run writes)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from memtrain.cli import app
from memtrain.commands.eval import eval_command
from memtrain.data.rows.identity import data_files
from memtrain.data.tokens.tokenizer import load_tokenizer
from memtrain.errors import UserError
from memtrain.model.config import model_config
from memtrain.recipe.schema import Model, Recipe
from memtrain.train.resolve import ResolvedRun

CHAT_DATA = {
    "train": [{"path": "builtin:chat", "type": "chat"}],
    "validation": [{"path": "builtin:chat/validation", "type": "chat"}],
    "template": "chatml",
    "seq_len": 64,
}
TEXT_DATA = {"train": "builtin:shakespeare", "validation": "builtin:shakespeare/validation", "seq_len": 64}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One token cache for the module: the chat data is tokenised once."""
    return tmp_path_factory.mktemp("cache")


def make_run(root: Path, data: dict, cache: Path, final: bool = True) -> Path:
    """A run directory as `memtrain run` leaves it: run.json, and final/ with a (random) model and tokenizer."""
    run_dir = root / "run"
    model = Model(preset="mini", tokenizer="builtin:shakespeare-chat")
    recipe = Recipe.model_validate(
        {
            "model": model.model_dump(),
            "data": {**data, "cache_dir": str(cache)},
            "precision": {"compute": "fp32"},
            "batch": {"global_batch": 8, "micro_batch": 4},
            "train": {"steps": 1, "eval_batches": 2},
        }
    )
    run_dir.mkdir(parents=True)
    ResolvedRun(
        name="run",
        recipe=recipe,
        run_dir=run_dir,
        recipe_micro_batch=4,
        micro_batch=4,
        total_steps=1,
        exact_pinned=True,
        plan_peak_reserved_bytes=None,
        planner_prior=None,
        data_files=data_files(recipe.data),
    ).save()
    if final:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(model_config(model)).save_pretrained(run_dir / "final")
        load_tokenizer(model).save_pretrained(run_dir / "final")
    return run_dir


def eval_json(run_dir: Path, **options) -> dict:
    out = io.StringIO()
    options = {"samples": 2, "limit": 6, **options}
    assert eval_command(run_dir, as_json=True, console=Console(file=out, width=200), **options) == 0
    return json.loads(out.getvalue())


def test_json_has_the_loss_exact_match_and_samples(tmp_path, cache):
    result = eval_json(make_run(tmp_path, CHAT_DATA, cache))
    assert result["loss"] > 0 and result["perplexity"] == pytest.approx(
        min(1e30, 2.718281828 ** result["loss"]), rel=1e-6
    )
    assert result["validation_rows"] == 8  # the run's own evaluation: eval_batches x micro-batch rows
    assert 0 < result["validation_target_tokens"] < 8 * 64  # the answers' tokens in those packed rows
    assert result["exact_match"] == 0.0 and result["total"] == 6 and result["correct"] == 0  # random weights
    assert [sorted(s) for s in result["samples"]] == [["correct", "expected", "generated", "question", "task"]] * 2
    assert result["samples"][0]["expected"] == "s" and result["note"] is None
    assert set(result["by_task"]) <= {
        "add",
        "subtract",
        "multiply",
        "reverse",
        "upper",
        "length",
        "first_letter",
        "add+follow_up",
        "subtract+follow_up",
        "multiply+follow_up",
    }


def test_text_only_data_gives_the_loss_and_says_why_there_is_no_exact_match(tmp_path, cache):
    result = eval_json(make_run(tmp_path, TEXT_DATA, cache))
    assert result["loss"] > 0 and result["exact_match"] is None and result["samples"] == []
    assert "no answers" in result["note"]
    chat = eval_json(make_run(tmp_path / "chat", CHAT_DATA, cache))
    assert set(result) == set(chat)  # one shape for every run: a script can read result["total"] of any
    assert all(result[key] is None for key in ("correct", "total", "skipped", "by_task"))


def test_the_table_shows_exact_match_and_samples(tmp_path, cache):
    out = io.StringIO()
    eval_command(
        make_run(tmp_path, CHAT_DATA, cache), as_json=False, samples=1, limit=3, console=Console(file=out, width=200)
    )
    text = out.getvalue()
    assert "exact match" in text and "0.000 (0/3 held-out answers)" in text and "first letter of 'sound'" in text


def test_held_out_data_with_other_bytes_is_refused_not_scored(tmp_path, cache):
    """The training file whose tail is held out, shuffled after the run, put trained records among the
    held-out ones, and eval scored them without a word."""
    path = tmp_path / "chat.jsonl"
    records = [
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": f"What is {i} plus 1?"},
                    {"role": "assistant", "content": str(i + 1)},
                ]
            }
        )
        for i in range(200)
    ]
    path.write_text("\n".join(records) + "\n")
    run_dir = make_run(
        tmp_path, {"train": [{"path": str(path), "type": "chat"}], "template": "chatml", "seq_len": 64}, cache
    )
    assert eval_json(run_dir, limit=2)["total"] == 2
    path.write_text("\n".join(reversed(records)) + "\n")
    with pytest.raises(UserError) as refused:
        eval_json(run_dir, limit=2)
    [problem] = refused.value.problems
    assert problem.key == "data.train" and problem.message == (
        f"{path} no longer holds the bytes the run was trained on, so the records it holds out are not the ones the "
        "run held out"
    )


def test_a_run_with_its_own_validation_file_is_scored_without_its_training_file(tmp_path, cache):
    """`eval` read the training file too, and failed when it had moved, though it scores none of it."""

    def conversations(start: int) -> str:
        return "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"What is {i} plus 1?"},
                        {"role": "assistant", "content": str(i + 1)},
                    ]
                }
            )
            + "\n"
            for i in range(start, start + 40)
        )

    (tmp_path / "train.jsonl").write_text(conversations(0))
    (tmp_path / "val.jsonl").write_text(conversations(100))
    run_dir = make_run(
        tmp_path,
        {
            "train": [{"path": str(tmp_path / "train.jsonl"), "type": "chat"}],
            "validation": [{"path": str(tmp_path / "val.jsonl"), "type": "chat"}],
            "template": "chatml",
            "seq_len": 64,
        },
        cache,
    )
    scored = eval_json(run_dir, limit=3)
    (tmp_path / "train.jsonl").rename(tmp_path / "moved.jsonl")
    again = eval_json(run_dir, limit=3)
    assert again["loss"] == scored["loss"] and again["total"] == scored["total"] == 3
    assert again["validation_rows"] == scored["validation_rows"] > 0
    # what the held-out prompts share with training: none, and with the training file gone, not known
    assert (scored["prompts_in_train"], again["prompts_in_train"]) == (0, None)


def test_eval_says_how_many_held_out_answers_training_also_holds(tmp_path, cache):
    """A validation file whose first two questions are also in the training file: the exact match says so."""

    def conversation(i: int) -> str:
        ask = {"role": "user", "content": f"What is {i} plus 2?"}
        return json.dumps({"messages": [ask, {"role": "assistant", "content": str(i + 2)}]}) + "\n"

    (tmp_path / "train.jsonl").write_text("".join(conversation(i) for i in range(40)))
    (tmp_path / "val.jsonl").write_text("".join(conversation(i) for i in (0, 1, 200, 201)))
    data = {
        "train": [{"path": str(tmp_path / "train.jsonl"), "type": "chat"}],
        "validation": [{"path": str(tmp_path / "val.jsonl"), "type": "chat"}],
        "template": "chatml",
        "seq_len": 64,
    }
    run_dir = make_run(tmp_path, data, cache)
    result = eval_json(run_dir)
    assert (result["total"], result["prompts_in_train"], result["answers_in_train"]) == (4, 2, 2)
    out = io.StringIO()
    eval_command(run_dir, as_json=False, samples=0, limit=None, console=Console(file=out, width=200))
    assert "(0/4 held-out answers, 2 of them also in training)" in out.getvalue()


def test_bad_inputs_are_user_errors(tmp_path, cache):
    with pytest.raises(UserError, match="there is no run directory"):
        eval_command(tmp_path / "nothing", as_json=True, samples=1, limit=None, console=Console(file=io.StringIO()))
    unfinished = make_run(tmp_path, CHAT_DATA, cache, final=False)
    with pytest.raises(UserError, match="no final model"):
        eval_command(unfinished, as_json=True, samples=1, limit=None, console=Console(file=io.StringIO()))
    with pytest.raises(UserError, match="--limit"):
        eval_command(unfinished, as_json=True, samples=1, limit=0, console=Console(file=io.StringIO()))


def test_the_cli_exits_2_without_a_traceback(tmp_path):
    result = CliRunner().invoke(app, ["eval", str(tmp_path / "nothing"), "--json"])
    assert result.exit_code == 2 and "Traceback" not in result.output
