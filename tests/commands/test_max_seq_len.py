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
from memtrain.train.setup import build_data

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


def long_chats(tmp_path: Path, conversations: int = 40) -> Path:
    """The 32k Qwen recipe over conversations of about 4,000 to 12,000 tokens (the bundled ones are a few hundred):
    far fewer sequences a packed row than rows of 256-token samples."""
    lines = [
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": f"Tell the whole story, number {i}."},
                    {"role": "assistant", "content": "the king and the queen spoke of war. " * (400 + 30 * i)},
                ]
            }
        )
        for i in range(conversations)
    ]
    (tmp_path / "long.jsonl").write_text("\n".join(lines) + "\n")
    recipe = tmp_path / "long-chat.yaml"
    recipe.write_text(f"""
extends: {RECIPES / "qwen2.5-7b-lora-long-24gb.yaml"}
data:
  train: [{{path: {tmp_path / "long.jsonl"}, type: chat}}]
  validation: [{{path: {tmp_path / "long.jsonl"}, type: chat}}]
  cache_dir: {tmp_path / "cache"}
""")
    return recipe


def test_data_of_long_samples_lengthens_the_answer_and_plans_it_as_plan_data_does(tmp_path):
    """Without the data the search prices rows of 256-token samples (306 sequences at 78k tokens); the data's rows at
    the same lengths hold ten or so conversations, so more tokens fit. The answer's plan is `plan --data`'s there."""
    recipe = long_chats(tmp_path)
    assumed = longest_seq_len(load_recipe(recipe).recipe)
    code, text = run(recipe, as_json=True, with_data=True)
    assert code == 0
    found = json.loads(text)["max_seq_len"]
    assert found["seq_len"] > assumed.seq_len and not found["model_limited"]
    assert found["packed_sequences_counted"] and found["densest_row_samples"] == found["packed_sequences"]
    assert assumed.plan.packed_sequences == assumed.seq_len // 256
    assert found["densest_row_samples"] < 20  # against 327 assumed at the answer's length
    _, at_answer = run(recipe, f"data.seq_len={found['seq_len']}", as_json=True, with_data=True, max_seq_len=False)
    plan = json.loads(at_answer)["plan"]
    assert plan["seq_len"] == found["seq_len"] and plan["packed_sequences_counted"]
    assert plan["packed_sequences"] == found["packed_sequences"]
    assert plan["peak_reserved_bytes"] == found["peak_reserved_bytes"]


def test_json_and_table_say_which_count_priced_the_attention_backward(tmp_path):
    """The data's densest row at the answer with --data, the assumption without; an 80 GiB card makes the model's
    131,072 positions the answer, which keeps the search short."""
    recipe = long_chats(tmp_path, conversations=16)
    card = "hardware.gpu=80GiB"
    _, assumed = run(recipe, card, as_json=True)
    _, counted = run(recipe, card, as_json=True, with_data=True)
    assumed_json, counted_json = json.loads(assumed), json.loads(counted)
    assumed, counted = assumed_json["max_seq_len"], counted_json["max_seq_len"]
    assert assumed["model_limited"] and counted["model_limited"] and counted["seq_len"] == 131_072
    assert (assumed["packed_sequences"], assumed["packed_sequences_counted"], assumed["densest_row_samples"]) == (
        512,  # 131,072 / 256
        False,
        None,
    )
    assert counted["packed_sequences_counted"] and counted["densest_row_samples"] == 16  # all in one row of 131,072
    # one packed row at the answer, against the recipe's global batch of 4 rows: an answer the run would refuse, said
    assert counted_json["rows_at_seq_len"] == counted_json["too_few_rows"] == 1
    assert "rows_at_seq_len" not in assumed_json
    said = {data: " ".join(run(recipe, card, with_data=data)[1].split()) for data in (True, False)}  # caption unwrapped
    assert f"priced for {counted['packed_sequences']} packed sequences a micro-batch" in said[True]
    assert f"(the data's densest row at 131,072 tokens: {counted['densest_row_samples']} samples)" in said[True]
    assert "priced for 512 packed sequences a micro-batch (assumed: samples of 256 tokens; --data counts" in said[False]
    assert "at 131,072 tokens the data makes 1 packed row, fewer than one global batch of 4" in said[True]
    assert "fewer than one global batch" not in said[False]


@pytest.mark.parametrize(
    "overrides",
    [
        (),  # windows end to end, validation from its own file
        ("data.packing=false", "data.validation=null"),  # each play cut into its own windows, a tail held out
    ],
)
def test_text_windows_are_counted_at_the_answer_as_the_run_builds_them(overrides):
    """Text holds one sequence a window at any length, but the windows get fewer as they get longer: with --data the
    answer says how many a run there trains on (the held-out tail left out), which the data built at that length
    gives too, and too few for the global batch is said."""
    recipe = RECIPES / "quickstart.yaml"
    _, text = run(recipe, *overrides, as_json=True, with_data=True)
    data = json.loads(text)
    answer = data["max_seq_len"]["seq_len"]
    assert answer == 2048  # the quickstart model's positions
    at_answer = load_recipe(
        recipe, [*overrides, f"data.seq_len={answer}", "batch.global_batch=1", "batch.micro_batch=1"]
    ).recipe
    windows = len(build_data(at_answer).train_set)
    assert data["rows_at_seq_len"] == windows > 0
    assert data["too_few_rows"] is None  # the quickstart's global batch of 16 fits in them
    crowded = f"batch.global_batch={windows + 1}", "batch.micro_batch=1"
    _, said = run(recipe, *overrides, *crowded, with_data=True)
    said = " ".join(said.split())
    assert f"at 2,048 tokens the data makes {windows} windows, fewer than one global batch of {windows + 1}" in said
