"""`memtrain eval --tasks` through lm-evaluation-harness, offline with a task of our own (a local JSONL file): the
harness scores the run's model, as the model's own log-likelihoods rank the choices, and the scores are recorded."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console

from memtrain.commands.eval import eval_command
from memtrain.train.state.saved_model import load_saved_model
from tests.commands.test_chat import train
from tests.conftest import read_records

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow

QUESTIONS = [
    ("What is the first letter of 'sound'?", ["s", "o", "d"], 0),
    ("What is the first letter of 'once'?", ["n", "o", "e"], 1),
    ("What is 12 - 0?", ["10", "2", "12"], 2),
    ("What is the first letter of 'king'?", ["k", "g", "i"], 0),
]
TASK = """task: memtrain_letters
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context), the continuation's tokens as the harness cuts them from the whole text."""
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    start = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        logits = model(torch.tensor([whole])).logits[0].log_softmax(-1)
    return sum(logits[i - 1, whole[i]].item() for i in range(start, len(whole)))


def test_a_local_task_scores_the_runs_model(tmp_path):
    run_dir = train(tmp_path, "bench", "train.steps=6", "train.save_every=6")
    data = tmp_path / "letters.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "letters.yaml").write_text(TASK.format(data=data))
    out = io.StringIO()
    code = eval_command(
        run_dir,
        as_json=True,
        samples=0,
        limit=None,
        console=Console(file=out),
        tasks=["memtrain_letters"],
        include_path=tasks,
    )
    assert code == 0
    scores = json.loads(out.getvalue())["benchmarks"]["memtrain_letters"]
    saved = load_saved_model(run_dir, torch.device("cpu"))
    right = [
        max(range(len(choices)), key=lambda k: loglikelihood(saved.model, saved.tokenizer, q, " " + choices[k])) == a
        for q, choices, a in QUESTIONS
    ]
    assert scores["acc"] == pytest.approx(sum(right) / len(right))
    (record,) = read_records(run_dir, "benchmark")
    assert record["task"] == "memtrain_letters" and record["acc"] == scores["acc"] and record["step"] == 6
