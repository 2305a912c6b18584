"""A run directory belongs to one run, trained by one process at a time; resume compares the recipe with the
checkpoint's (unit tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memtrain.cli import app
from memtrain.errors import UserError
from memtrain.train.resolve import RunOptions
from memtrain.train.state.checkpoint import STATE_FILE, remove_leftovers
from memtrain.train.state.manifest import write_manifest
from memtrain.train.state.resume import differences
from memtrain.train.state.rundir import LOCK_FILE, RunDirLock, claim_run_dir, start_metrics


def fake_checkpoint(run_dir: Path, step: int) -> Path:
    path = run_dir / "checkpoints" / f"step-{step:06d}"
    (path / "state").mkdir(parents=True)
    (path / STATE_FILE).write_text(json.dumps({"step": step}))
    return path


def write_metrics(run_dir: Path, records: list[dict], torn: bool = False) -> Path:
    path = run_dir / "metrics.jsonl"
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + ('{"kind": "tra' if torn else ""))
    return path


def test_no_resume_into_a_directory_with_checkpoints_is_refused_naming_the_ways_out(tmp_path):
    run_dir = tmp_path / "run"
    fake_checkpoint(run_dir, 60)
    with pytest.raises(UserError) as refused:
        claim_run_dir(run_dir, RunOptions(resume=False))
    text = str(refused.value)
    assert "step-000060" in text and "train.output_dir" in text and "--overwrite" in text
    assert (run_dir / "checkpoints" / "step-000060").is_dir()  # nothing touched
    assert claim_run_dir(run_dir, RunOptions(resume=True)) == []  # a resume is what the directory is for


def test_overwrite_moves_the_whole_old_run_aside(tmp_path):
    run_dir = tmp_path / "run"
    fake_checkpoint(run_dir, 60)
    write_metrics(run_dir, [{"kind": "train", "step": 1}])
    notes = claim_run_dir(run_dir, RunOptions(resume=False, overwrite=True))
    assert not run_dir.exists()
    [moved] = tmp_path.glob("run.previous-*")
    assert (moved / "checkpoints" / "step-000060" / STATE_FILE).is_file() and (moved / "metrics.jsonl").is_file()
    assert str(moved) in notes[0]


def test_metrics_keep_one_history_per_directory(tmp_path):
    records = (
        [{"kind": "run", "step": 0, "event": "start"}]
        + [{"kind": "train", "step": s, "loss": 1.0} for s in range(1, 8)]
        + [{"kind": "checkpoint", "step": 5}]
    )
    path = write_metrics(tmp_path, records, torn=True)
    assert start_metrics(tmp_path, 5) == 3  # steps 6 and 7 are redone by the resumed run; the torn line goes too
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in kept if r["kind"] == "train"] == [1, 2, 3, 4, 5]
    assert kept[-1]["kind"] == "checkpoint"
    (tmp_path / "tensorboard").mkdir()
    start_metrics(tmp_path, None)  # a start from step 0: nothing of the earlier attempt stays
    assert path.read_text() == "" and not (tmp_path / "tensorboard").exists()


def test_the_leftovers_of_killed_saves_and_prunes_are_removed(tmp_path):
    good = fake_checkpoint(tmp_path, 6)
    half_pruned = tmp_path / "checkpoints" / "step-000003"
    (half_pruned / "state").mkdir(parents=True)  # a kill during pruning: an empty state/, no state file
    (tmp_path / "checkpoints" / ".del-step-000002").mkdir()
    (tmp_path / "checkpoints" / ".tmp-step-000009").mkdir()
    removed = remove_leftovers(tmp_path)
    assert sorted(p.name for p in removed) == [".del-step-000002", ".tmp-step-000009", "step-000003"]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [good.name]


def test_a_complete_save_killed_before_its_rename_is_put_in_place_not_deleted(tmp_path):
    """A save of a step that already had a checkpoint moves the old copy aside, then renames the new one in: a kill
    between the two leaves the step's only complete copy in `.tmp-` (its state file, written last, says so)."""
    fake_checkpoint(tmp_path, 4)
    complete = fake_checkpoint(tmp_path, 6)
    write_manifest(complete)  # what the save writes last
    complete = complete.rename(tmp_path / "checkpoints" / ".tmp-step-000006")
    (tmp_path / "checkpoints" / ".del-step-000006").mkdir()  # the old copy, being deleted
    (tmp_path / "checkpoints" / ".tmp-step-000008" / "state").mkdir(parents=True)  # a save killed half-way
    remove_leftovers(tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000004", "step-000006"]
    assert not complete.exists() and (tmp_path / "checkpoints" / "step-000006" / STATE_FILE).is_file()


def test_what_a_killed_export_left_is_removed_at_start_up_and_nothing_else(tmp_path):
    fake_checkpoint(tmp_path, 12)
    (tmp_path / "final").mkdir()
    (tmp_path / ".final.db26676940c7.tmp").mkdir()  # SIGKILL during the export
    (tmp_path / ".final.db26676940c7.tmp" / "config.json").write_text("{}")
    (tmp_path / ".final.0123456789ab.old").mkdir()  # SIGKILL while the old final/ was being deleted
    (tmp_path / ".final.notes").write_text("a user's")
    (tmp_path / "checkpoints" / ".tmp-step-000013").mkdir()
    assert claim_run_dir(tmp_path, RunOptions()) == []
    assert sorted(os.listdir(tmp_path)) == [".final.notes", "checkpoints", "final"]
    assert os.listdir(tmp_path / "checkpoints") == ["step-000012"]


def test_recipe_changes_are_split_into_breaking_and_safe():
    old = {
        "model": {"preset": "micro", "lora": None},
        "data": {"seq_len": 32, "cache_dir": "a"},
        "batch": {"global_batch": 8, "micro_batch": 4},
        "optimizer": {"name": "adamw", "lr": 0.003},
        "precision": {"compute": "fp32"},
        "train": {"seed": 7, "steps": 10, "eval_every": 5},
    }
    new = json.loads(json.dumps(old))
    new["data"].update(seq_len=64, cache_dir="b")
    new["model"]["lora"] = {"r": 4}
    new["batch"].update(global_batch=16, micro_batch=2)
    new["optimizer"].update(name="adamw_8bit", lr=0.001)
    new["precision"]["compute"] = "bf16"
    new["train"].update(seed=8, steps=20, eval_every=2)
    breaking, safe = differences(old, new)
    assert [c.key for c in breaking] == [
        "batch.global_batch",
        "data.seq_len",
        "model.lora",
        "optimizer.name",
        "precision.compute",
        "train.seed",
    ]
    assert str(breaking[2]) == 'model.lora (unset) → {"r": 4}'  # one change, not one per field
    assert [c.key for c in safe] == [
        "batch.micro_batch",
        "data.cache_dir",
        "optimizer.lr",
        "train.eval_every",
        "train.steps",
    ]
    assert str(safe[2]) == "optimizer.lr 0.003 → 0.001"


def test_a_list_of_datasets_is_compared_item_by_item():
    """A changed data path was said as the whole list of dataset specs, one JSON line."""
    old = {
        "data": {
            "train": [{"path": "a.jsonl", "type": "chat"}, {"path": "b.jsonl", "type": "chat"}],
            "validation": None,
        }
    }
    new = json.loads(json.dumps(old))
    new["data"]["train"][1]["path"] = "c.jsonl"
    [change], [] = differences(old, new)
    assert str(change) == 'data.train.1.path "b.jsonl" → "c.jsonl"'
    new["data"]["train"].append({"path": "d.jsonl", "type": "chat"})  # another length: the list as a whole
    [change], [] = differences(old, new)
    assert change.key == "data.train"


def _hold_in_another_process(run_dir: Path) -> subprocess.Popen:
    """A process holding `run_dir` as a running `memtrain run` does, until it is killed."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom memtrain.train.state.rundir import RunDirLock\n"
            f"held = RunDirLock({str(run_dir)!r}).acquire()\nprint('held', flush=True)\ntime.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_run_into_a_directory_in_use_is_refused_naming_the_holder(write_recipe, tmp_path):
    recipe = write_recipe()
    run_dir = tmp_path / "runs" / "tiny"
    holder = _hold_in_another_process(run_dir)
    try:
        for flags in ([], ["--overwrite"], ["--no-resume"]):
            result = CliRunner().invoke(app, ["run", str(recipe), *flags])
            assert result.exit_code == 2, result.output
            said = " ".join(result.output.split())
            assert f"{run_dir} is in use: memtrain run (pid {holder.pid}" in said and "train.output_dir" in said
            assert [path.name for path in run_dir.iterdir()] == [LOCK_FILE]  # nothing written, nothing moved
            assert not list(tmp_path.glob("runs/tiny.previous-*"))
    finally:
        holder.kill()
        holder.wait()
    # its holder gone (killed: the kernel released the lock), the directory is free
    with RunDirLock(run_dir):
        assert (run_dir / LOCK_FILE).read_text().startswith(f"memtrain run (pid {os.getpid()} ")
    assert not run_dir.exists()  # the lock was all it held: nothing is left


def test_overwrite_takes_the_new_directory_and_leaves_the_lock_behind(tmp_path):
    run_dir = tmp_path / "run"
    fake_checkpoint(run_dir, 60)
    with RunDirLock(run_dir) as lock:
        claim_run_dir(run_dir, RunOptions(resume=False, overwrite=True), lock)
        [moved] = tmp_path.glob("run.previous-*")
        assert not (moved / LOCK_FILE).exists() and (moved / "checkpoints").is_dir()
        assert (run_dir / LOCK_FILE).is_file()  # the new directory is held
        refused = subprocess.run(
            [
                sys.executable,
                "-c",
                f"from memtrain.train.state.rundir import RunDirLock\nRunDirLock({str(run_dir)!r}).acquire()",
            ],
            capture_output=True,
            text=True,
        )
        assert refused.returncode != 0 and "is in use" in refused.stderr


def test_an_output_dir_where_a_file_is_is_refused_at_its_key(tmp_path):
    (tmp_path / "chat.yaml").write_text("not a directory")
    for run_dir in (tmp_path / "chat.yaml", tmp_path / "chat.yaml" / "run"):
        with pytest.raises(UserError) as refused:
            RunDirLock(run_dir).acquire()
        [problem] = refused.value.problems
        assert problem.key == "train.output_dir" and "a file is in the way" in problem.message
    assert (tmp_path / "chat.yaml").read_text() == "not a directory"


@pytest.mark.slow
def test_running_a_finished_run_again_does_nothing_and_says_where_its_model_is(write_recipe, tmp_path):
    recipe = write_recipe()
    run_dir = tmp_path / "runs" / "tiny"
    assert CliRunner().invoke(app, ["run", str(recipe)]).exit_code == 0
    written = {path: path.stat().st_mtime_ns for path in run_dir.rglob("*") if path.name != LOCK_FILE}
    again = CliRunner().invoke(app, ["run", str(recipe)])
    assert again.exit_code == 0, again.output
    said = " ".join(again.output.split())
    assert f"already trained: 10 of 10 steps, model in {run_dir / 'final'}; nothing to do" in said
    assert "resuming" not in said
    assert {path: path.stat().st_mtime_ns for path in run_dir.rglob("*") if path.name != LOCK_FILE} == written
    longer = CliRunner().invoke(app, ["run", str(recipe), "train.steps=12"])  # more steps: it resumes
    assert longer.exit_code == 0 and "resuming from step 10" in " ".join(longer.output.split())


def test_a_run_directory_that_cannot_be_created_says_why_at_its_key(tmp_path, monkeypatch):
    """As files.cannot_create says it for every output (this machine runs as root: permission is simulated)."""

    def refused(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "mkdir", refused)
    with pytest.raises(UserError) as raised:
        RunDirLock(tmp_path / "run").acquire()
    [problem] = raised.value.problems
    assert problem.key == "train.output_dir"
    assert (
        problem.message
        == f"cannot create '{tmp_path / 'run' / LOCK_FILE}': no permission to create files in '{tmp_path}'"
    )


def test_the_validation_set_does_not_depend_on_the_card_the_auto_micro_batch_is_sized_for():
    """batch.micro_batch 'auto' (the default) is sized for the card, so counting train.eval_batches in micro-batches
    of that size made two cards evaluate different validation sets; they count batches of 4 samples instead."""
    from memtrain.recipe.load import load_recipe
    from memtrain.train.resolve import resolve_run

    recipe = Path(__file__).resolve().parents[3] / "recipes" / "tinyllama-1.1b-full-offload-24gb.yaml"
    runs = {
        gpu: resolve_run(
            load_recipe(recipe, [f"hardware.gpu={gpu}"]).recipe, "r", Path("/tmp/unused"), 10_000, exact_pinned=True
        )
        for gpu in ("rtx3090", "6GiB")
    }
    assert runs["rtx3090"].micro_batch == 16 and runs["6GiB"].micro_batch < 16  # the planner sized them apart
    assert runs["rtx3090"].eval_samples == runs["6GiB"].eval_samples == 8 * 4
    fixed = resolve_run(
        load_recipe(recipe, ["batch.micro_batch=2"]).recipe, "r", Path("/tmp/unused"), 10_000, exact_pinned=True
    )
    assert fixed.eval_samples == 8 * 2  # a recipe that names its micro-batch counts in it, as before


def test_a_run_says_the_micro_batch_auto_chose_and_why(tmp_path):
    """With the default 'auto' nothing said which micro-batch the run trains at."""
    from memtrain.checks.load import load_checked
    from memtrain.train.launch import prepare
    from memtrain.train.step.hooks import Hooks

    recipe = Path(__file__).resolve().parents[3] / "recipes" / "quickstart.yaml"
    auto = prepare(load_checked(recipe, ["batch.micro_batch=auto", f"data.cache_dir={tmp_path}"]), Hooks())
    assert (
        "micro-batch 16 (batch.micro_batch auto: the largest that divides the 16 samples per GPU and step and "
        "fits rtx3090; 1 micro-batch per step)"
    ) in auto.notes
    fixed = prepare(load_checked(recipe, [f"data.cache_dir={tmp_path}"]), Hooks())
    assert not [note for note in fixed.notes if "batch.micro_batch auto" in note]
