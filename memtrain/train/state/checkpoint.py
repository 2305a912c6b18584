"""Atomic checkpoints and exact resume.

A checkpoint is written into `checkpoints/.tmp-step-NNNNNN/` (DeepSpeed's model, optimizer and
scheduler state, one RNG file per rank, and `memtrain_state.json` last), then renamed to
`checkpoints/step-NNNNNN/`. A run killed mid-save leaves only a `.tmp-` directory, which is never
loaded and is removed by the next save (or at start-up); the last complete checkpoint stays intact.

Pruning renames an old checkpoint to `.del-step-NNNNNN/` before deleting it, so a run killed while
pruning leaves a `.del-` directory (removed by the next save), never a `step-` directory with part of
its files; a save of a step that already has a checkpoint moves the old one aside the same way, and
deletes it only once the new one is in place. Pruning to `keep_last` happens before a save as well as
after it: before, to keep_last - 1 (at least 1), so the disk holds at most max(keep_last, 2)
checkpoints at once, and a lower keep_last frees room for the very save that ran out of it.
`memtrain_state.json` also records the recipe the checkpoint was trained with, so a resume can tell what
changed (memtrain.train.state.resume).

After the state file comes the manifest (manifest.py: each file's size and checksum), written last and atomically.
A checkpoint is trusted only when it verifies (`checkpoint_problem`): its state file reads, and its files are those
its manifest lists. Before a resume, `set_aside_unverified` moves the newest checkpoints that do not verify to
`corrupt-step-NNNNNN/` (nothing is deleted: a file put back makes it whole again) and the run resumes from the newest
that does; a `.tmp-` directory is put in place only when its manifest is there and verifies. A checkpoint of an older
memtrain has no manifest: it is accepted as before, once its state file reads and each torch file in it is a whole
archive (a truncated or empty one is not).

A model with frozen parameters (LoRA, QLoRA, DoRA) saves only what trains: its base is left out of the checkpoint
and recorded by a fingerprint instead (`frozen_base.json`), which a resume compares with the base it loaded again
(frozen_base.py).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import zipfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from memtrain.errors import Problem, UserError
from memtrain.train.optim.in_backward import StepInBackward
from memtrain.train.runtime.distributed import barrier
from memtrain.train.state.frozen_base import (
    base_problem,
    fingerprint,
    has_frozen_parameters,
    load_without_base,
    read_record,
    write_record,
)
from memtrain.train.state.manifest import has_manifest, manifest_problem, write_manifest

DS_TAG = "state"
STATE_FILE = "memtrain_state.json"
_STEP_DIR = re.compile(r"^step-(\d{6,})$")
CORRUPT_PREFIX = "corrupt-"  # where a checkpoint that does not verify is moved aside


@dataclass
class LoopState:
    """Everything the loop needs besides DeepSpeed's state to continue exactly."""

    step: int = 0  # optimizer steps done
    tokens: int = 0  # real input tokens trained on, padding left out (all ranks)
    target_tokens: int = 0  # tokens the loss was computed on (all ranks)
    padded_tokens: int = 0  # token positions computed, padding included (all ranks)
    best_eval_loss: float | None = None
    batch_policy: dict = field(default_factory=dict)
    recipe: dict = field(default_factory=dict)  # the resolved recipe trained with (JSON); {} in older checkpoints
    divergence: dict = field(default_factory=dict)  # the divergence guard's state (Guard.state_dict); {} before it


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    """Where the complete checkpoint of `step` lives."""
    return checkpoint_root(run_dir) / f"step-{step:06d}"


def step_of_name(checkpoint: Path) -> int:
    """The step a checkpoint directory holds, read from its name (step-NNNNNN); resume.checkpoint_step reads it
    from the state file inside."""
    return int(_STEP_DIR.match(checkpoint.name).group(1))


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=step_of_name)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def remove_leftovers(run_dir: Path, said: list[str] | None = None) -> list[Path]:
    """Delete what killed saves and prunes left: `.tmp-`/`.del-` directories and `step-` directories
    without their state file (a partial prune by an older memtrain). Returns what was removed.

    A `.tmp-step-N` whose manifest (written last) is there and verifies is complete; when `step-N` is missing it is
    renamed into place, not deleted: a save of a step that already had a checkpoint was killed between moving the old
    copy aside and renaming the new one in, and it is that step's only complete copy. One that holds a state file
    but does not verify is removed, and a line for people saying why goes to `said`."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    for tmp in root.glob(".tmp-step-*"):
        final = root / tmp.name[len(".tmp-") :]
        if not _STEP_DIR.match(final.name) or not (tmp / STATE_FILE).is_file() or final.exists():
            continue
        problem = checkpoint_problem(tmp) or (None if has_manifest(tmp) else "its save did not finish (no manifest)")
        if problem is None:
            os.replace(tmp, final)
        elif said is not None:
            said.append(f"removed {tmp.name}, a save killed before it was complete: {problem}")
    stale = [
        p
        for p in root.iterdir()
        if p.is_dir()
        and (
            p.name.startswith((".tmp-step-", ".del-step-"))
            or (_STEP_DIR.match(p.name) and not (p / STATE_FILE).is_file())
        )
    ]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def checkpoint_problem(checkpoint: Path) -> str | None:
    """Why `checkpoint` cannot be trusted (said for people), or None when it verifies: its state file reads and
    names its step, and its files are those its manifest lists. Without a manifest (a checkpoint of an older
    memtrain) each torch file must be a whole archive: torch writes its zip's directory last, so a truncated or
    empty file has none."""
    try:
        state = json.loads((checkpoint / STATE_FILE).read_text())
        step = int(state["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"its {STATE_FILE} is not readable"
    named = _STEP_DIR.match(checkpoint.name.removeprefix(".tmp-"))  # a complete save's, or one being put in place
    if named and int(named.group(1)) != step:
        return f"its {STATE_FILE} is of step {step}"
    if has_manifest(checkpoint):
        return manifest_problem(checkpoint)
    for path in sorted(checkpoint.rglob("*.pt")):
        try:
            with zipfile.ZipFile(path):
                pass
        except (OSError, zipfile.BadZipFile):
            return f"{path.relative_to(checkpoint).as_posix()} is not a whole torch file (truncated or empty)"
    return None


def set_aside_unverified(run_dir: Path) -> list[str]:
    """Before a resume: move the newest checkpoints that do not verify aside (`corrupt-step-N/`), so the newest one
    left is one that does; returns the line that says which were skipped and why ([] when the newest verifies).
    Raises UserError when none verifies: the run cannot resume, and starting over is the user's choice. Rank 0,
    with the run directory's lock held."""
    found = complete_checkpoints(run_dir)
    bad: list[tuple[Path, str]] = []
    for checkpoint in reversed(found):
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            break
        bad.append((checkpoint, problem))
    else:
        if bad:
            raise UserError(
                Problem(
                    f"no checkpoint in {checkpoint_root(run_dir)} verifies, so the run cannot resume: "
                    + "; ".join(f"{path.name}: {problem}" for path, problem in bad),
                    key="train.output_dir",
                    hint="put back the checkpoint's files from a copy, or start over: --no-resume --overwrite moves "
                    "this run aside (or train elsewhere: train.output_dir=runs/NEW)",
                )
            )
    if not bad:
        return []
    moved = [(path, problem, _set_aside(path)) for path, problem in bad]
    return [
        "skipped checkpoints that do not verify, moved aside (delete them once you no longer need them): "
        + "; ".join(f"{path.name} ({problem}) → {aside.name}" for path, problem, aside in moved)
    ]


def _set_aside(checkpoint: Path) -> Path:
    aside, n = checkpoint.with_name(CORRUPT_PREFIX + checkpoint.name), 1
    while aside.exists():
        n += 1
        aside = checkpoint.with_name(f"{CORRUPT_PREFIX}{checkpoint.name}-{n}")
    os.replace(checkpoint, aside)
    return aside


def _device_sub_groups(engine) -> tuple[object, dict[int, torch.Tensor]]:
    """ZeRO-3's partial offload (`offload.ratio` < 1): the optimizer that updates the sub-groups kept on
    the GPU, and those sub-groups' master weights by sub-group index. DeepSpeed 0.19.8 keeps their Adam
    moments in that second optimizer (`backup_optimizer`), which its checkpoints leave out."""
    zero = getattr(engine, "optimizer", None)
    backup = getattr(zero, "backup_optimizer", None)
    if backup is None:
        return None, {}
    return backup, {
        i: zero.fp32_partitioned_groups_flat[i] for i, device in zero.subgroup_to_device.items() if device != "cpu"
    }


def device_sub_group_states(engine) -> dict[int, dict]:
    """The optimizer states of the sub-groups a partial offload keeps on the GPU (empty without one)."""
    backup, groups = _device_sub_groups(engine)
    return {i: backup.state[master] for i, master in groups.items() if master in backup.state}


def restore_device_sub_group_states(engine, states: dict[int, dict]) -> None:
    """Put back what `device_sub_group_states` saved; a run that keeps other sub-groups on the GPU than
    the checkpoint did cannot continue exactly, so it stops."""
    backup, groups = _device_sub_groups(engine)
    if set(states) - set(groups):
        raise RuntimeError(
            f"the checkpoint's optimizer kept sub-groups {sorted(states)} on the GPU, this run "
            f"keeps {sorted(groups)}: resume with the offload.ratio the run started with"
        )
    for i, state in states.items():
        backup.state[groups[i]] = state


def partial_save(run_dir: Path, step: int) -> Path:
    """Where a save of `step` writes before it is complete."""
    return checkpoint_root(run_dir) / f".tmp-step-{step:06d}"


def save_checkpoint(
    engine, run_dir: Path, state: LoopState, rank: int, keep_last: int, fault: Callable[[Path], None] | None = None
) -> Path:
    """Write a checkpoint atomically (all ranks call this) and prune to the newest keep_last.

    `fault(tmp)` (tests): called once the engine's files are written, before the state file.
    """
    root = checkpoint_root(run_dir)
    tmp, final = partial_save(run_dir, state.step), checkpoint_dir(run_dir, state.step)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        remove_leftovers(run_dir)
        prune(run_dir, kept_while_saving(keep_last), kept_through(state))
        tmp.mkdir()
    barrier()
    # a model with frozen parameters (LoRA's base) saves only what trains; the base is recorded instead (frozen_base.py)
    leave_out_base = has_frozen_parameters(engine.module)
    base = fingerprint(engine.module, engine.device) if leave_out_base else None
    engine.save_checkpoint(str(tmp), tag=DS_TAG, exclude_frozen_parameters=leave_out_base)
    if base is not None and rank == 0:
        write_record(tmp, base)
    device_states = device_sub_group_states(engine)
    if device_states:
        torch.save(device_states, tmp / f"device-optimizer-rank{rank}.pt")
    torch.save(_rng_state(), tmp / f"rng-rank{rank}.pt")
    if fault is not None:
        fault(tmp)
    barrier()
    if rank == 0:
        state_path = tmp / STATE_FILE
        state_path.write_text(json.dumps(asdict(state), indent=2))
        with open(state_path) as handle:
            os.fsync(handle.fileno())
        # last, atomically: a save killed before this has no manifest, and is never put in place (remove_leftovers)
        write_manifest(tmp)
        if final.exists():  # a save of the same step (e.g. after an OOM): the old copy stays whole until replaced
            old = _doomed(final)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        prune(run_dir, keep_last, kept_through(state))
    barrier()
    return final


def kept_while_saving(keep_last: int) -> int:
    """How many complete checkpoints stay while the next one is written: one fewer than keep_last, for the
    new one, but never none (a save that fails must leave a checkpoint to resume from)."""
    return max(keep_last - 1, 1)


def prune(run_dir: Path, keep: int, keep_through: int | None = None) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints (rank 0); returns what was deleted. `keep_through`: a
    step whose newest checkpoint at or before it stays too (the guard's last one from before the loss diverged,
    LoopState.divergence)."""
    found = complete_checkpoints(run_dir)
    kept_old = [p for p in found if keep_through is not None and step_of_name(p) <= keep_through][-1:]
    pruned = [p for p in found[:-keep] if p not in kept_old]
    for old in pruned:
        doomed = _doomed(old)
        os.replace(old, doomed)  # never a step- directory with part of its files
        shutil.rmtree(doomed, ignore_errors=True)
    return pruned


def kept_through(state: LoopState) -> int | None:
    """The step through which pruning keeps a checkpoint beside the newest ones (see `prune`), from the guard's
    saved state; None in checkpoints from before it or while the loss is not far above its best."""
    step = (state.divergence or {}).get("keep_through")
    return int(step) if isinstance(step, int) else None


def _doomed(checkpoint: Path) -> Path:
    """Where a checkpoint goes to be deleted: a name no resume loads and the next save removes."""
    return checkpoint.with_name(f".del-{checkpoint.name}")


@contextmanager
def _loaded_to_host(engine):
    """With optimizer.step_in_backward (ZeRO stage 0), DeepSpeed loads the saved weights and optimizer states back
    onto the device they were saved from, beside the model's own weights: a second copy of a 7B model does not fit
    a 24 GB card (measured: out of memory at 22.8 GiB on resume). Loaded on the host instead (measured on the GPU:
    the 7B run resumed and went on, benchmarks/host_memory.csv), memory-mapped, the weights are
    copied into the model's parameters and the per-parameter optimizers place their states (train/optim/in_backward.py).
    Every other run loads as DeepSpeed does (ZeRO stages load their partitions their own way)."""
    if not isinstance(engine.optimizer, StepInBackward):
        yield
        return
    checkpoints = engine.checkpoint_engine
    load = checkpoints.load
    # memory-mapped: the files' pages are read as the weights and states are copied out of them, and stay page
    # cache the kernel can drop. Read whole (DeepSpeed's torch.load), the 7B resume peaked at 40.2 GiB of host
    # memory machine-wide (benchmarks/host_memory.csv), over the 32 GiB host the recipe is for.
    checkpoints.load = lambda path, map_location=None: torch.load(
        path, map_location=torch.device("cpu"), mmap=True, weights_only=False
    )
    try:
        yield
    finally:
        checkpoints.load = load


def load_checkpoint(engine, path: Path, rank: int, base_key: str = "model") -> LoopState:
    """Restore DeepSpeed's model/optimizer/scheduler state, this rank's RNG, and the loop state. A checkpoint saved
    without the frozen base (frozen_base.py) is refused, naming `base_key`, when this run loaded another base, and
    loads non-strictly once the keys it lacks are found to be the frozen parameters only."""
    recorded = read_record(path)
    if recorded is not None:
        problem = base_problem(recorded, fingerprint(engine.module, engine.device), path, base_key)
        if problem is not None:
            raise UserError([problem, _cannot_resume(path)])
    with _loaded_to_host(engine):
        engine.load_checkpoint(
            str(path),
            tag=DS_TAG,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
            load_module_strict=recorded is None,
            custom_load_fn=None if recorded is None else _load_without_base(path),
        )
    device_states = path / f"device-optimizer-rank{rank}.pt"
    if device_states.is_file():
        restore_device_sub_group_states(engine, torch.load(device_states, weights_only=False))
    rng = path / f"rng-rank{rank}.pt"
    if rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=False))
    return loop_state((path / STATE_FILE).read_text())


def _load_without_base(checkpoint: Path) -> Callable:
    """DeepSpeed's module load (`custom_load_fn`) for a checkpoint without the frozen parameters: refuses one whose
    keys are not this model's less its frozen parameters, else loads non-strictly (frozen_base.load_without_base)."""

    def load(src: dict, dst: torch.nn.Module) -> None:
        problem = load_without_base(src, dst, checkpoint)
        if problem is not None:
            raise UserError([problem, _cannot_resume(checkpoint)])

    return load


def _cannot_resume(checkpoint: Path) -> Problem:
    return Problem(
        f"cannot resume {checkpoint} exactly with this model",
        hint="undo the change to resume, or start a new run: in another directory (train.output_dir=runs/NEW) or "
        "over this one (--no-resume --overwrite moves the old run aside)",
    )


def loop_state(text: str) -> LoopState:
    """The loop state a checkpoint's STATE_FILE holds. One from before the three token counts kept only `tokens`,
    which counted targets: it becomes target_tokens, and real tokens go on from it (a low count, never a wrong
    target count)."""
    saved = json.loads(text)
    if "target_tokens" not in saved:
        saved["target_tokens"] = saved.get("tokens", 0)
    return LoopState(**saved)
