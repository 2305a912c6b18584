"""`memtrain export --push-to-hub`: the model card it uploads, and the refusals said before any work. Without network
the upload itself is not tested: only up to the point where huggingface_hub would be asked to create the repo."""

from __future__ import annotations

import yaml
from huggingface_hub import ModelCard, constants
from typer.testing import CliRunner

from memtrain.cli import app
from memtrain.commands.model_card import model_card
from memtrain.monitor.metrics import GENERATION_KIND, MetricsLog
from memtrain.recipe.schema import Recipe

RECIPE = {
    "name": "weather-lora",
    "model": {"path": "hub:org/base", "revision": "a" * 40, "lora": {"r": 8, "alpha": 16}},
    "data": {
        "train": [{"path": "hub:org/chat", "type": "chat"}],
        "validation": [{"path": "hub:org/chat", "type": "chat", "split": "test"}],
        "seq_len": 512,
    },
    "train": {"steps": 10, "output_dir": "/somewhere/runs/weather"},
}


def finished_adapter_run(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "final").mkdir(parents=True)
    (run_dir / "final" / "adapter_config.json").write_text("{}")
    (run_dir / "recipe.json").write_text(Recipe.model_validate(RECIPE).model_dump_json())
    with MetricsLog(run_dir / "metrics.jsonl", flush_every=1) as log:
        log.event("eval", 5, loss=2.0)
        log.event("eval", 10, loss=1.25)
        log.event(GENERATION_KIND, 10, exact_match=0.25, correct=1, total=4, skipped=0, by_task={}, samples=[])
    return run_dir


def test_the_card_names_the_base_the_data_and_the_scores(tmp_path):
    run_dir = finished_adapter_run(tmp_path)
    card = ModelCard(str(model_card(run_dir, Recipe.model_validate(RECIPE), adapter=True)))
    assert card.data.base_model == "org/base" and card.data.library_name == "peft"
    assert card.data.datasets == ["org/chat"] and card.data.tags == ["memtrain", "lora"]
    text = card.text
    assert "A LoRA adapter of [org/base](https://huggingface.co/org/base) at commit `" + "a" * 40 + "`" in text
    assert "| held-out loss | 1.2500 at step 10 (perplexity 3.49) |" in text  # the last evaluation's
    assert "| exact match | 0.250 (1/4 held-out answers) |" in text
    assert (
        "| method | LoRA r=8, alpha=16 |" in text and "| data | `hub:org/chat`, `hub:org/chat` (split test) |" in text
    )
    recipe = yaml.safe_load(text.split("```yaml\n")[1].split("```")[0])
    assert recipe["model"]["lora"]["r"] == 8 and "output_dir" not in recipe["train"]  # the run's own paths left out


def test_the_card_says_how_many_held_out_answers_training_also_holds(tmp_path):
    run_dir = finished_adapter_run(tmp_path)
    with MetricsLog(run_dir / "metrics.jsonl", flush_every=1) as log:
        log.event(GENERATION_KIND, 12, exact_match=1.0, correct=4, total=4, prompts_in_train=3, by_task={}, samples=[])
    text = model_card(run_dir, Recipe.model_validate(RECIPE), adapter=True).text
    assert "| exact match | 1.000 (4/4 held-out answers, 3 of them also in training) |" in text


def test_an_alpaca_card_says_how_to_prompt_a_task_with_an_input(tmp_path):
    run_dir = finished_adapter_run(tmp_path)
    alpaca = {**RECIPE, "data": {"train": [{"path": "hub:org/alpaca", "type": "instruction"}], "template": "alpaca"}}
    text = model_card(run_dir, Recipe.model_validate(alpaca), adapter=True).text
    assert "## Prompting" in text and '"input": "Good morning"' in text
    assert "## Prompting" not in model_card(run_dir, Recipe.model_validate(RECIPE), adapter=True).text  # chat: none


def test_a_push_that_cannot_happen_is_said_before_any_work(tmp_path, monkeypatch, hub_cache):
    run_dir = finished_adapter_run(tmp_path)
    runner = CliRunner()
    bad = runner.invoke(app, ["export", str(run_dir), "--push-to-hub", "not a repo"])
    assert bad.exit_code == 2 and "is not a Hub repo id" in bad.output
    offline = runner.invoke(app, ["export", str(run_dir), "--merge", "--push-to-hub", "me/weather"])
    assert offline.exit_code == 2 and "HF_HUB_OFFLINE is set" in " ".join(offline.output.split())
    assert not (run_dir / "merged").exists()  # refused before the merge
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"))
    anonymous = runner.invoke(app, ["export", str(run_dir), "--merge", "--push-to-hub", "me/weather"])
    assert anonymous.exit_code == 2 and "no Hugging Face token" in anonymous.output
    assert "hf auth login" in " ".join(anonymous.output.split()) and not (run_dir / "merged").exists()
