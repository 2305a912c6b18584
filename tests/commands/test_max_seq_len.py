"""`memtrain plan --max-seq-len`: the longest data.seq_len that fits, by bisection over the plan, and its levers."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from memtrain.commands.plan import plan_command
from memtrain.errors import RecipeError
from memtrain.plan.planner import plan_recipe
from memtrain.plan.seq_len import SEQ_LEN_STEP, longest_seq_len, with_seq_len
from memtrain.recipe.load import load_recipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def run(path: Path, *overrides: str, **options) -> tuple[int, str]:
    console = Console(file=io.StringIO(), width=160, color_system=None)
    options = {"gpu": None, "fit": False, "output": None, "as_json": False, "max_seq_len": True, **options}
    code = plan_command(path, list(overrides), console=console, **options)
    return code, console.file.getvalue()


@pytest.mark.parametrize("name", ["llama2-13b-qlora-24gb.yaml", "llama2-7b-lora-24gb.yaml"])
def test_the_answer_fits_with_margin_and_one_step_more_does_not(name):
    recipe = load_recipe(RECIPES / name).recipe
    found = longest_seq_len(recipe)
    assert found.seq_len % SEQ_LEN_STEP == 0 and 0 < found.seq_len < found.limit
    at = plan_recipe(with_seq_len(recipe, found.seq_len))
    beyond = plan_recipe(with_seq_len(recipe, found.seq_len + SEQ_LEN_STEP))
    assert at.fits and not at.tight
    assert not beyond.fits or beyond.tight
    assert at.peak_reserved_bytes < beyond.peak_reserved_bytes
    # the shortest length that misses outright does miss, and the one before it fits (maybe tight)
    assert not plan_recipe(with_seq_len(recipe, found.first_miss)).fits
    assert plan_recipe(with_seq_len(recipe, found.first_miss - SEQ_LEN_STEP)).fits


def test_the_model_positions_end_the_search_where_the_card_does_not():
    recipe = load_recipe(RECIPES / "quickstart.yaml").recipe
    found = longest_seq_len(recipe)
    assert found.seq_len == found.limit == 2048  # the quickstart model's positions, far below the card
    assert found.model_limited and found.next_plan is None and found.first_miss == 0


def test_a_card_too_small_for_even_one_step_says_so():
    recipe = load_recipe(RECIPES / "llama2-7b-lora-24gb.yaml", ["hardware.gpu=8GiB"]).recipe
    found = longest_seq_len(recipe)
    assert found.seq_len == 0 and found.plan is None


def test_json_gives_the_length_its_plan_and_levers_that_each_reach_further():
    code, text = run(RECIPES / "llama2-13b-qlora-24gb.yaml", as_json=True)
    data = json.loads(text)
    assert code == 0
    found = data["max_seq_len"]
    assert found["seq_len"] >= 1024 and found["next_seq_len"] == found["seq_len"] + SEQ_LEN_STEP
    assert found["peak_reserved_bytes"] < found["next_peak_reserved_bytes"]
    assert data["levers"], "a lever (a smaller micro-batch at least) lengthens the 13B QLoRA recipe"
    for lever in data["levers"]:
        assert lever["seq_len"] > found["seq_len"] and lever["overrides"]
        lengthened = load_recipe(
            RECIPES / "llama2-13b-qlora-24gb.yaml", [*lever["overrides"], f"data.seq_len={lever['seq_len']}"]
        ).recipe
        plan = plan_recipe(lengthened)
        assert plan.fits and not plan.tight


def test_the_table_names_the_length_and_the_step_that_misses():
    code, text = run(RECIPES / "llama2-13b-qlora-24gb.yaml")
    found = longest_seq_len(load_recipe(RECIPES / "llama2-13b-qlora-24gb.yaml").recipe)
    assert code == 0
    assert f"{found.seq_len:,}" in text and f"{found.seq_len + SEQ_LEN_STEP:,}" in text
    assert "changes that lengthen it" in text


def test_max_seq_len_with_fit_is_a_recipe_error():
    with pytest.raises(RecipeError, match="--max-seq-len"):
        run(RECIPES / "quickstart.yaml", fit=True)
