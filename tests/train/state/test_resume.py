"""Resume compares the data as built, not only the recipe that names it (fast: no training, real data built)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memtrain.data.rows.identity import data_files, data_fingerprint
from memtrain.errors import UserError
from memtrain.recipe.schema import Lora, Recipe
from memtrain.train.resolve import RUN_FILE, ResolvedRun, RunOptions, with_zero_stage
from memtrain.train.setup import build_data
from memtrain.train.state.checkpoint import STATE_FILE, checkpoint_root
from memtrain.train.state.resume import (
    UNCOMPARED_DATA_NOTE,
    check_resume,
    differences,
    recipe_json,
    refuse_changed_files,
)


def conversations(n: int, answer_of_first: str = "2") -> str:
    records = [
        {
            "messages": [
                {"role": "user", "content": f"What is {i} plus 1?"},
                {"role": "assistant", "content": answer_of_first if i == 1 else str(i + 1)},
            ]
        }
        for i in range(n)
    ]
    return "".join(json.dumps(r) + "\n" for r in records)


def chat_recipe(tmp_path: Path, validation: bool = False, **train) -> Recipe:
    """Chat data in tmp_path (train.jsonl, and val.jsonl with `validation`), written when not there yet."""
    files = {"train.jsonl": 24, **({"val.jsonl": 6} if validation else {})}
    for name, records in files.items():
        if not (tmp_path / name).exists():
            (tmp_path / name).write_text(conversations(records))
    data = {
        "train": [{"path": str(tmp_path / "train.jsonl"), "type": "chat"}],
        "template": "chatml",
        "seq_len": 64,
        "add_special_tokens": True,
        "cache_dir": str(tmp_path / "cache"),
    }
    if validation:
        data["validation"] = [{"path": str(tmp_path / "val.jsonl"), "type": "chat"}]
    return Recipe.model_validate(
        {
            "model": {"preset": "micro", "tokenizer": "builtin:shakespeare"},
            "data": data,
            "batch": {"global_batch": 4, "micro_batch": 4},
            "train": {"steps": 6, "output_dir": str(tmp_path / "run"), **train},
        }
    )


def resolved(recipe: Recipe) -> ResolvedRun:
    """The run as `prepare` resolves it, with the fingerprint of the data built now (the planner left out)."""
    data = build_data(recipe)
    return ResolvedRun(
        name="run",
        recipe=with_zero_stage(recipe),
        run_dir=Path(recipe.train.output_dir),
        recipe_micro_batch=4,
        micro_batch=4,
        total_steps=recipe.train.steps,
        exact_pinned=True,
        plan_peak_reserved_bytes=None,
        planner_prior=None,
        data_fingerprint=data_fingerprint(recipe.data, data.train_set, data.val_set),
        data_files=data_files(recipe.data),
    )


def trained(run: ResolvedRun, step: int = 3) -> None:
    """The run directory as a run that saved at `step` leaves it: run.json and a checkpoint's state file."""
    checkpoint = checkpoint_root(run.run_dir) / f"step-{step:06d}"
    checkpoint.mkdir(parents=True)
    (checkpoint / STATE_FILE).write_text(json.dumps({"step": step, "recipe": recipe_json(run.recipe)}))
    run.save()


def refusal(run: ResolvedRun) -> str:
    with pytest.raises(UserError) as refused:
        check_resume(run, RunOptions())
    return "\n".join(p.format() for p in refused.value.problems)


def test_the_same_data_built_again_has_the_same_fingerprint_and_resumes_without_a_note(tmp_path):
    trained(resolved(chat_recipe(tmp_path)))
    plan = check_resume(resolved(chat_recipe(tmp_path)), RunOptions())
    assert plan is not None and plan.step == 3 and plan.notes == ()


def lora_recipe(tmp_path: Path) -> Recipe:
    """chat_recipe with LoRA adapters: `offload.zero_stage: auto` gives it ZeRO-1 on one GPU."""
    recipe = chat_recipe(tmp_path)
    lora = Lora(r=4, modules_to_save=["embed_tokens", "lm_head"])  # the chat markers are new tokens
    return recipe.model_copy(update={"model": recipe.model.model_copy(update={"lora": lora})})


def test_the_run_records_the_zero_stage_it_runs_with_not_auto(tmp_path):
    run = resolved(lora_recipe(tmp_path))
    assert run.recipe.offload.zero_stage == 1  # one GPU holding everything
    trained(run)
    recorded = json.loads(next(checkpoint_root(run.run_dir).iterdir()).joinpath(STATE_FILE).read_text())["recipe"]
    assert recorded["offload"]["zero_stage"] == 1


def older_auto_checkpoint(run: ResolvedRun) -> None:
    """A checkpoint as a memtrain that recorded `offload.zero_stage: auto` wrote it: auto meant ZeRO-2 on one GPU."""
    trained(run)
    state = next(checkpoint_root(run.run_dir).iterdir()) / STATE_FILE
    record = json.loads(state.read_text())
    record["recipe"]["offload"]["zero_stage"] = "auto"
    state.write_text(json.dumps(record))


def test_a_checkpoint_recorded_with_auto_was_zero2_and_is_not_resumed_at_zero1(tmp_path):
    older_auto_checkpoint(resolved(lora_recipe(tmp_path)))
    said = refusal(resolved(lora_recipe(tmp_path)))
    assert "offload.zero_stage: changed since the checkpoint: offload.zero_stage 2 → 1" in said
    assert "written by ZeRO stage 2: set offload.zero_stage=2 to resume it" in said


def test_the_way_back_resumes_it_and_a_full_fine_tune_recorded_with_auto_resumes_as_it_was(tmp_path):
    older_auto_checkpoint(resolved(lora_recipe(tmp_path)))
    recipe = lora_recipe(tmp_path)
    at_zero2 = recipe.model_copy(update={"offload": recipe.offload.model_copy(update={"zero_stage": 2})})
    plan = check_resume(resolved(at_zero2), RunOptions())
    assert plan is not None and plan.step == 3 and plan.applied == ()
    (tmp_path / "full").mkdir()
    full = chat_recipe(tmp_path / "full")  # auto still gives a full fine-tune ZeRO-2
    older_auto_checkpoint(resolved(full))
    assert check_resume(resolved(full), RunOptions()).applied == ()


def test_one_changed_record_of_the_training_file_is_refused_at_data_train(tmp_path):
    trained(resolved(chat_recipe(tmp_path)))
    (tmp_path / "train.jsonl").write_text(conversations(24, answer_of_first="3"))  # same count, one answer differs
    said = refusal(resolved(chat_recipe(tmp_path)))
    assert f"data.train: changed since the checkpoint: the samples built from {tmp_path / 'train.jsonl'} differ" in said
    assert "a file's contents changed" in said and "put back the data" in said
    assert "the tokenizer or its chat template changed" in said  # an edited template, not the files
    assert "--no-resume --overwrite" in said and "train.output_dir=runs/NEW" in said


def test_a_removed_record_is_refused_too(tmp_path):
    trained(resolved(chat_recipe(tmp_path)))
    (tmp_path / "train.jsonl").write_text(conversations(23))
    assert "data.train: changed since the checkpoint" in refusal(resolved(chat_recipe(tmp_path)))


def test_a_changed_validation_file_is_refused_at_data_validation_only(tmp_path):
    trained(resolved(chat_recipe(tmp_path, validation=True)))
    (tmp_path / "val.jsonl").write_text(conversations(5))
    said = refusal(resolved(chat_recipe(tmp_path, validation=True)))
    assert "data.validation: changed since the checkpoint" in said and str(tmp_path / "val.jsonl") in said
    assert "data.train:" not in said


def test_a_recipe_change_that_also_changes_the_samples_says_either_may_be_the_cause(tmp_path):
    trained(resolved(chat_recipe(tmp_path)))
    changed = chat_recipe(tmp_path).model_copy(deep=True)
    changed.data.seq_len = 48
    said = refusal(resolved(changed))
    assert "data.seq_len 64 → 48" in said and "or a change listed here" in said


def test_a_run_recorded_without_a_fingerprint_resumes_with_a_note(tmp_path):
    run = resolved(chat_recipe(tmp_path))
    trained(run)
    recorded = json.loads((run.run_dir / RUN_FILE).read_text())
    del recorded["data_fingerprint"]  # as an older memtrain wrote run.json
    (run.run_dir / RUN_FILE).write_text(json.dumps(recorded))
    (tmp_path / "train.jsonl").write_text(conversations(23))
    plan = check_resume(resolved(chat_recipe(tmp_path)), RunOptions())
    assert plan is not None and plan.step == 3
    assert plan.notes == (UNCOMPARED_DATA_NOTE,) and UNCOMPARED_DATA_NOTE in plan.lines()
    assert ResolvedRun.from_json((run.run_dir / RUN_FILE).read_text()).data_fingerprint is None  # old run.json loads


def test_eval_generate_can_change_on_resume_and_is_said_to_apply(tmp_path):
    trained(resolved(chat_recipe(tmp_path, eval_generate=5)))
    plan = check_resume(resolved(chat_recipe(tmp_path, eval_generate=0)), RunOptions())
    assert plan is not None and [str(c) for c in plan.applied] == ["train.eval_generate 5 → 0"]


def test_the_seed_stays_refused_beside_an_eval_generate_change():
    """The seed shapes the weights and the sample order; eval_generate neither."""
    breaking, safe = differences({"train": {"seed": 7, "eval_generate": 5}}, {"train": {"seed": 8, "eval_generate": 0}})
    assert [c.key for c in breaking] == ["train.seed"] and [c.key for c in safe] == ["train.eval_generate"]


def test_the_text_path_fingerprints_its_windows_and_a_changed_text_file_differs(tmp_path):
    text = tmp_path / "plays.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 40)
    recipe = Recipe.model_validate(
        {
            "model": {"preset": "micro", "tokenizer": "builtin:shakespeare"},
            "data": {"train": str(text), "seq_len": 16, "cache_dir": str(tmp_path / "cache")},
            "batch": {"global_batch": 4, "micro_batch": 4},
        }
    )
    before = resolved(recipe).data_fingerprint
    assert before is not None and list(before) == ["data.train"]  # the validation tail is data.train's
    assert resolved(recipe).data_fingerprint == before
    text.write_text("To be, or not to be, that is the question!\n" * 40)
    assert resolved(recipe).data_fingerprint != before


def test_a_changed_file_is_refused_before_the_data_is_built_and_an_unchanged_one_passes(tmp_path):
    run = resolved(chat_recipe(tmp_path, validation=True))
    trained(run)
    recipe = chat_recipe(tmp_path, validation=True)
    refuse_changed_files(run.run_dir, RunOptions(), recipe, data_files(recipe.data))  # nothing changed: no word
    (tmp_path / "val.jsonl").write_text(conversations(6).replace("plus", "and"))
    with pytest.raises(UserError) as refused:
        refuse_changed_files(run.run_dir, RunOptions(), recipe, data_files(recipe.data))
    [changed, closing] = refused.value.problems
    assert changed.key == "data.validation" and str(tmp_path / "val.jsonl") in changed.message
    assert "cannot resume" in closing.message
    refuse_changed_files(run.run_dir, RunOptions(resume=False), recipe, data_files(recipe.data))  # a new run
    recorded = json.loads((run.run_dir / RUN_FILE).read_text())
    del recorded["data_files"]  # a run.json written before data files were recorded: check_resume compares it later
    (run.run_dir / RUN_FILE).write_text(json.dumps(recorded))
    refuse_changed_files(run.run_dir, RunOptions(), recipe, data_files(recipe.data))


def test_a_recipe_that_names_other_data_is_left_to_the_recipe_comparison(tmp_path):
    """A changed data spec (a split, a dropped validation set) is no changed bytes: check_resume says it."""
    run = resolved(chat_recipe(tmp_path, validation=True))
    trained(run)
    changed = chat_recipe(tmp_path, validation=True).model_copy(deep=True)
    changed.data.validation = None
    refuse_changed_files(run.run_dir, RunOptions(), changed, data_files(changed.data))  # not this check's to say
    said = refusal(resolved(changed))
    assert "data.validation" in said and "no longer holds the bytes" not in said


def test_a_path_recorded_as_typed_resumes_as_the_same_file(tmp_path, monkeypatch):
    """A run.json may hold a data path typed relative on the command line, recorded as typed; today's recipe has it
    absolute (so `eval` finds it from any directory). Resuming from where the run started is no recipe change."""
    monkeypatch.chdir(tmp_path)
    run = resolved(chat_recipe(tmp_path))
    recorded = recipe_json(run.recipe)
    recorded["data"]["train"][0]["path"] = "train.jsonl"
    checkpoint = checkpoint_root(run.run_dir) / "step-000003"
    checkpoint.mkdir(parents=True)
    (checkpoint / STATE_FILE).write_text(json.dumps({"step": 3, "recipe": recorded}))
    run.save()
    assert check_resume(run, RunOptions()).step == 3
    recorded["data"]["train"][0]["path"] = "other.jsonl"  # another file: a change, as before
    (checkpoint / STATE_FILE).write_text(json.dumps({"step": 3, "recipe": recorded}))
    said = refusal(run)
    assert said.startswith(
        f'data.train.0.path: changed since the checkpoint: data.train.0.path "{tmp_path}/other.jsonl" '
        f'→ "{tmp_path}/train.jsonl"'
    )


def test_a_run_resumed_on_a_machine_that_replays_no_cuda_graphs_goes_on():
    """train.cuda_graphs resolves per machine (no CUDA, no graphs): how the same kernels are launched may change on
    resume; what they compute, such as the seed, may not."""
    breaking, safe = differences(
        {"train": {"seed": 7, "cuda_graphs": True}}, {"train": {"seed": 8, "cuda_graphs": False}}
    )
    assert [c.key for c in breaking] == ["train.seed"] and [c.key for c in safe] == ["train.cuda_graphs"]
