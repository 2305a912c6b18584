"""checkpoint.save_checkpoint on real files: how many checkpoints a save needs room for, and that a step's only
complete copy survives a kill at any point of its replacement. The engine's part of a save is a file it writes:
what DeepSpeed writes does not matter to the order of renames and deletions."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from memtrain.errors import UserError
from memtrain.train.state import checkpoint
from memtrain.train.state.checkpoint import (
    LoopState,
    complete_checkpoints,
    latest_checkpoint,
    remove_leftovers,
    save_checkpoint,
)
from memtrain.train.state.manifest import MANIFEST_FILE


class FilesEngine:
    """The part of a DeepSpeed engine save_checkpoint uses: it writes its state into the directory it is given, for a
    module that trains all its weights (a full fine-tune: no frozen base to leave out)."""

    module = torch.nn.Linear(2, 2)
    device = torch.device("cpu")

    def save_checkpoint(self, path: str, tag: str, exclude_frozen_parameters: bool = False) -> None:
        (Path(path) / tag).mkdir()
        (Path(path) / tag / "model_states.pt").write_bytes(b"\0" * 1024)


def names(run_dir: Path) -> list[str]:
    return [p.name for p in complete_checkpoints(run_dir)]


@pytest.mark.parametrize("keep_last, peak", [(1, 2), (2, 2), (3, 3)])
def test_a_save_needs_room_for_max_keep_last_2_checkpoints_not_keep_last_plus_one(tmp_path, keep_last, peak):
    """A full disk's advice was 'lower train.keep_last', but pruning came only after the new checkpoint was in place:
    a save always needed room for keep_last + 1, and a lowered keep_last freed nothing before the save that failed."""
    at_fault = []
    for step in range(1, 6):
        save_checkpoint(
            FilesEngine(),
            tmp_path,
            LoopState(step=step),
            rank=0,
            keep_last=keep_last,
            fault=lambda tmp: at_fault.append(len(complete_checkpoints(tmp_path)) + 1),
        )  # + the partial
        assert len(complete_checkpoints(tmp_path)) == min(step, keep_last)  # what stays between saves is as before
    assert max(at_fault) == peak


def test_a_lower_keep_last_frees_room_before_the_save_that_ran_out_of_it(tmp_path):
    """keep_last 2 left step-2 and step-4, and the save of step 6 found no room; the run resumed with
    keep_last=1 must delete step-2 before it writes step 6, and a failed save keeps step 4 to resume from."""
    for step in (2, 4):
        save_checkpoint(FilesEngine(), tmp_path, LoopState(step=step), rank=0, keep_last=3)
    assert names(tmp_path) == ["step-000002", "step-000004"]

    def full(tmp):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))

    with pytest.raises(OSError):
        save_checkpoint(FilesEngine(), tmp_path, LoopState(step=6), rank=0, keep_last=1, fault=full)
    assert names(tmp_path) == ["step-000004"]  # the room for step 6 was made; step 4 stays to resume from


@pytest.mark.parametrize("killed_at", [1, 2, 3])
def test_saving_a_step_again_keeps_a_complete_copy_of_it_at_every_moment(tmp_path, monkeypatch, killed_at):
    """The OOM paths save the current step again: the old copy was deleted before the new one was renamed in, so a
    kill between the two left no copy of the step (with keep_last=1, nothing to resume from)."""
    save_checkpoint(FilesEngine(), tmp_path, LoopState(step=4, tokens=1), rank=0, keep_last=1)
    calls = {"n": 0}
    replace, rmtree = os.replace, shutil.rmtree

    def kill_at(real):
        def call(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == killed_at:
                raise SystemExit("killed")  # nothing after this point of save_checkpoint runs
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(checkpoint.os, "replace", kill_at(replace))
    monkeypatch.setattr(checkpoint.shutil, "rmtree", kill_at(rmtree))
    with pytest.raises(SystemExit):
        save_checkpoint(FilesEngine(), tmp_path, LoopState(step=4, tokens=2), rank=0, keep_last=1)
    monkeypatch.undo()
    remove_leftovers(tmp_path)  # what the next run does at start-up, before it looks for a checkpoint
    found = latest_checkpoint(tmp_path)
    assert found is not None and found.name == "step-000004"
    assert json.loads((found / checkpoint.STATE_FILE).read_text())["tokens"] in (1, 2)  # the old copy or the new


def test_a_state_from_before_the_three_token_counts_keeps_its_count_as_targets():
    old = checkpoint.loop_state(json.dumps({"step": 3, "tokens": 700}))
    assert (old.step, old.target_tokens, old.tokens, old.padded_tokens) == (3, 700, 700, 0)
    state = checkpoint.LoopState(step=3, tokens=900, target_tokens=300, padded_tokens=1000)
    assert checkpoint.loop_state(json.dumps(dataclasses.asdict(state))) == state


class TorchFilesEngine(FilesEngine):
    """An engine whose save writes real torch files, as DeepSpeed's does: model states of a few tensors."""

    def save_checkpoint(self, path: str, tag: str, exclude_frozen_parameters: bool = False) -> None:
        (Path(path) / tag).mkdir()
        torch.save({"weight": torch.arange(200_000, dtype=torch.float32)}, Path(path) / tag / MODEL_STATES)


MODEL_STATES = "mp_rank_00_model_states.pt"


def saved_run(run_dir: Path, steps=(2, 4, 6)) -> None:
    for step in steps:
        save_checkpoint(TorchFilesEngine(), run_dir, LoopState(step=step), rank=0, keep_last=3)


def damage_truncate(checkpoint_path: Path) -> None:
    model = checkpoint_path / "state" / MODEL_STATES
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])


def damage_zeros(checkpoint_path: Path) -> None:
    """64 KB of zeros over the middle of the model states, the size unchanged: a zip that still opens."""
    model = checkpoint_path / "state" / MODEL_STATES
    with open(model, "r+b") as handle:
        handle.seek(model.stat().st_size // 2)
        handle.write(b"\0" * 65536)


def damage_state(checkpoint_path: Path) -> None:
    (checkpoint_path / checkpoint.STATE_FILE).write_text('{"step": 6, "tok')


def damage_rng(checkpoint_path: Path) -> None:
    (checkpoint_path / "rng-rank0.pt").write_bytes(b"")


@pytest.mark.parametrize("damage", [damage_truncate, damage_zeros, damage_state, damage_rng])
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_newest_that_verifies_is_resumed(tmp_path, damage):
    """A truncated model-states file gave a zip-reader traceback at every rerun, a garbled state file a JSONDecodeError,
    an empty RNG file 'Aborted.', and 64 KB of zeros loaded silently."""
    saved_run(tmp_path)
    assert json.loads((tmp_path / "checkpoints" / "step-000006" / MANIFEST_FILE).read_text())["files"]
    damage(tmp_path / "checkpoints" / "step-000006")
    [line] = checkpoint.set_aside_unverified(tmp_path)
    assert "step-000006" in line and "corrupt-step-000006" in line, line
    assert names(tmp_path) == ["step-000002", "step-000004"]
    assert (tmp_path / "checkpoints" / "corrupt-step-000006" / "state").is_dir()  # nothing deleted
    assert checkpoint.set_aside_unverified(tmp_path) == []  # the newest left verifies


def test_the_line_says_what_is_wrong_with_each_skipped_checkpoint(tmp_path):
    saved_run(tmp_path)
    damage_truncate(tmp_path / "checkpoints" / "step-000006")
    damage_zeros(tmp_path / "checkpoints" / "step-000004")
    [line] = checkpoint.set_aside_unverified(tmp_path)
    assert f"step-000006 (state/{MODEL_STATES} holds" in line and "were saved" in line
    assert "step-000004 (" in line and "checksum differs" in line
    assert names(tmp_path) == ["step-000002"]


def test_no_checkpoint_that_verifies_is_a_user_error_and_nothing_is_moved(tmp_path):
    saved_run(tmp_path, steps=(2, 4))
    for step in (2, 4):
        damage_state(tmp_path / "checkpoints" / f"step-{step:06d}")
    with pytest.raises(UserError) as raised:
        checkpoint.set_aside_unverified(tmp_path)
    [problem] = raised.value.problems
    assert "no checkpoint" in problem.message and "step-000004: its memtrain_state.json is not readable" in (
        problem.message
    )
    assert problem.key == "train.output_dir" and "--overwrite" in problem.hint
    assert names(tmp_path) == ["step-000002", "step-000004"]


def test_a_checkpoint_without_a_manifest_is_accepted_unless_a_torch_file_is_cut(tmp_path):
    """An older memtrain wrote no manifest: such a checkpoint resumes as before, but a truncated file is found."""
    saved_run(tmp_path, steps=(2, 4))
    for step in (2, 4):
        (tmp_path / "checkpoints" / f"step-{step:06d}" / MANIFEST_FILE).unlink()
    assert checkpoint.set_aside_unverified(tmp_path) == []
    damage_rng(tmp_path / "checkpoints" / "step-000004")
    [line] = checkpoint.set_aside_unverified(tmp_path)
    assert "rng-rank0.pt is not a whole torch file" in line
    assert names(tmp_path) == ["step-000002"]


@pytest.mark.parametrize("damage", [damage_state, damage_truncate, None])
def test_a_temporary_is_put_in_place_only_when_it_verifies(tmp_path, damage):
    """A `.tmp-step-N` holding a half-written state file was promoted at start-up and then failed to load."""
    saved_run(tmp_path, steps=(2, 4))
    tmp = (tmp_path / "checkpoints" / "step-000004").rename(tmp_path / "checkpoints" / ".tmp-step-000004")
    if damage is not None:
        damage(tmp)
    said: list[str] = []
    remove_leftovers(tmp_path, said)
    if damage is None:
        assert names(tmp_path) == ["step-000002", "step-000004"] and said == []
    else:
        assert names(tmp_path) == ["step-000002"] and not tmp.exists()
        [line] = said
        assert line.startswith("removed .tmp-step-000004, a save killed before it was complete: "), line


def test_a_temporary_whose_save_was_killed_before_the_manifest_is_not_put_in_place(tmp_path):
    saved_run(tmp_path, steps=(2, 4))
    tmp = (tmp_path / "checkpoints" / "step-000004").rename(tmp_path / "checkpoints" / ".tmp-step-000004")
    (tmp / MANIFEST_FILE).unlink()
    said: list[str] = []
    remove_leftovers(tmp_path, said)
    assert names(tmp_path) == ["step-000002"] and "no manifest" in said[0]


def test_while_the_loss_is_far_above_its_best_the_checkpoint_from_before_it_is_not_pruned(tmp_path):
    """A diverged run (loss 60-244, no NaN) kept only the diverged checkpoints."""
    for step in range(1, 7):
        far = {"keep_through": 2} if step >= 4 else {}  # the best loss at step 2, far above it from step 4
        save_checkpoint(FilesEngine(), tmp_path, LoopState(step=step, divergence=far), rank=0, keep_last=2)
    assert names(tmp_path) == ["step-000002", "step-000005", "step-000006"]
    save_checkpoint(FilesEngine(), tmp_path, LoopState(step=7, divergence={"keep_through": None}), rank=0, keep_last=2)
    assert names(tmp_path) == ["step-000006", "step-000007"]  # the loss came back: pruned as before


def test_a_checkpoint_named_for_chat_or_eval_that_does_not_verify_is_refused_with_the_others_named(tmp_path):
    from memtrain.train.state.saved_model import checkpoint_path

    saved_run(tmp_path, steps=(2, 4))
    assert checkpoint_path(tmp_path, "4") == tmp_path / "checkpoints" / "step-000004"
    damage_zeros(tmp_path / "checkpoints" / "step-000004")
    with pytest.raises(UserError) as raised:
        checkpoint_path(tmp_path, "4")
    [problem] = raised.value.problems
    assert "does not verify" in problem.message and "checksum differs" in problem.message
    assert problem.hint == "give another of the run's steps (2, 4)"
