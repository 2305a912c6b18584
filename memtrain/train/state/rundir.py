"""A run directory belongs to one run.

Its checkpoints, metrics and final model describe one sequence of optimizer steps. Four rules keep
it so:
- One process trains into it at a time: `RunDirLock` holds an advisory lock on `.memtrain-run.lock` inside
  it for the whole run (the kernel releases it when the process ends, however it ends), and a second
  `memtrain run` into it, or an `--overwrite` of it, is refused while the first holds it.
- `--no-resume` into a directory that holds a run (a complete checkpoint or a final model) is refused:
  the new run's checkpoints would be pruned in favour of the old run's higher step numbers, and a
  later resume would pick the old run up again. `--overwrite` moves the old run aside first
  (`NAME.previous-YYYYmmdd-HHMMSS/` beside it: renamed whole, nothing copied, nothing lost).
- A run that starts from step 0 (no checkpoint) replaces the metrics an earlier attempt left.
- A run resumed from step S drops the metric records of steps after S (those of the steps it is
  about to redo), so metrics.jsonl holds each step once and `memtrain report` reads one history.

What killed saves and exports left (checkpoint.remove_leftovers, and the temporaries beside final/) is
removed at start-up, under the lock, before the resume looks for the newest checkpoint; then the newest checkpoints
that do not verify are moved aside (checkpoint.set_aside_unverified), so every rank resumes from one that does.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
import time
from pathlib import Path
from typing import IO

from memtrain.errors import Problem, UserError
from memtrain.files import cannot_create, leftovers, write_atomically
from memtrain.monitor.metrics import METRICS_FILE
from memtrain.train.resolve import RunOptions
from memtrain.train.state.checkpoint import complete_checkpoints, remove_leftovers, set_aside_unverified

FINAL_DIR = "final"
TENSORBOARD_DIR = "tensorboard"
LOCK_FILE = ".memtrain-run.lock"


class RunDirLock:
    """This process's hold on a run directory, from `acquire` to `release` (or the process's end)."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self._file: IO[str] | None = None

    def acquire(self) -> RunDirLock:
        """Take the directory (creating it), or raise a UserError naming the process that holds it."""
        self.release()
        path = self.run_dir / LOCK_FILE
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            file = open(path, "a+")  # noqa: SIM115 — held open for the run's life, closed by release()
        except (FileExistsError, NotADirectoryError):
            raise UserError(
                Problem(
                    f"{self.run_dir} cannot be a run directory: a file is in the way",
                    key="train.output_dir",
                    hint="choose another train.output_dir",
                )
            ) from None
        except OSError as error:  # no permission, a read-only or full filesystem: files.cannot_create says which
            raise UserError(dataclasses.replace(cannot_create(path, error), key="train.output_dir")) from None
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "another process"
            file.close()
            raise UserError(
                Problem(
                    f"{self.run_dir} is in use: {holder} is training into it",
                    key="train.output_dir",
                    hint="wait for that run to end (or stop it: Ctrl-C saves, then this command resumes it), or train "
                    "somewhere else (train.output_dir=runs/NEW)",
                )
            ) from None
        except OSError:  # a filesystem without locks (some network mounts): run unguarded rather than not at all
            pass
        file.seek(0)
        file.truncate()
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        file.write(f"memtrain run (pid {os.getpid()} on {os.uname().nodename}, since {since})\n")
        file.flush()
        self._file = file
        return self

    def release(self) -> None:
        """Let the directory go; a directory the run left with nothing else in it is removed."""
        if self._file is None:
            return
        self._file.close()
        self._file = None
        if self.run_dir.is_dir() and [path.name for path in self.run_dir.iterdir()] == [LOCK_FILE]:  # leave nothing
            (self.run_dir / LOCK_FILE).unlink(missing_ok=True)
            try:
                self.run_dir.rmdir()
            except OSError:
                pass

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _contents(run_dir: Path) -> list[Path]:
    """What a run directory holds, but its lock."""
    return [path for path in run_dir.iterdir() if path.name != LOCK_FILE]


def holds_a_run(run_dir: Path) -> bool:
    """Whether `run_dir` holds a run that a new one would mix with: a complete checkpoint or a final model."""
    return bool(complete_checkpoints(run_dir)) or (run_dir / FINAL_DIR).is_dir()


def archive_run(run_dir: Path) -> Path:
    """Move the whole run directory aside (one rename) and return where it went."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = run_dir.with_name(f"{run_dir.name}.previous-{stamp}")
    suffix = 1
    while target.exists():
        suffix += 1
        target = run_dir.with_name(f"{run_dir.name}.previous-{stamp}-{suffix}")
    os.replace(run_dir, target)
    return target


def claim_run_dir(run_dir: Path, options: RunOptions, lock: RunDirLock | None = None) -> list[str]:
    """Make `run_dir` this run's before anything is written; return what was done, for people.

    Raises UserError for `--no-resume` into a directory that holds a run, unless `--overwrite`, and for a resume
    when no checkpoint verifies. `lock`, held on `run_dir`, is taken again on the new directory when --overwrite
    moves the old one (and its lock file) aside.
    """
    run_dir = Path(run_dir)
    if not run_dir.exists():
        return []
    said: list[str] = []
    if not options.overwrite:  # --overwrite moves them aside with the rest
        remove_leftovers(run_dir, said)  # before the resume picks a checkpoint: it may finish a killed save
        remove_export_leftovers(run_dir)
    if options.resume and not options.overwrite:
        return said + set_aside_unverified(run_dir)
    if options.overwrite:
        if not _contents(run_dir):
            return []
        moved = archive_run(run_dir)
        if lock is not None:
            lock.acquire()
            (moved / LOCK_FILE).unlink(missing_ok=True)
        return [f"moved the previous run in {run_dir} to {moved} (--overwrite); delete it when you no longer need it"]
    if holds_a_run(run_dir):
        found = complete_checkpoints(run_dir)
        what = f"checkpoints up to {found[-1].name}" if found else "a final model"
        raise UserError(
            Problem(
                f"the run directory {run_dir} holds another run ({what}); --no-resume would mix the two "
                "(pruning keeps the old run's higher steps, and a later resume would continue the old run)",
                key="train.output_dir",
                hint=f"train somewhere else (train.output_dir=runs/NEW), resume it (drop --no-resume), or start over "
                f"with --overwrite (the old run is moved to {run_dir.name}.previous-DATE beside it)",
            )
        )
    return said


def remove_export_leftovers(run_dir: Path) -> list[Path]:
    """Delete what a killed export left beside final/ (files.atomic_path's `.final.*.tmp` temporaries and an old
    final/ renamed aside): a 7B export killed half-way leaves gigabytes in a hidden directory that nothing reads.
    Called at start-up with the run directory's lock held, so no export of another process is under way."""
    stale = leftovers(Path(run_dir) / FINAL_DIR)
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return stale


def start_metrics(run_dir: Path, resume_step: int | None) -> int:
    """Make metrics.jsonl this attempt's: keep the records up to `resume_step` (None: a start from step 0,
    nothing kept, TensorBoard's events too). Returns how many records were dropped. Rank 0 only."""
    path = Path(run_dir) / METRICS_FILE
    if resume_step is None:
        shutil.rmtree(Path(run_dir) / TENSORBOARD_DIR, ignore_errors=True)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    with open(path, "rb") as file:
        for raw in file:
            try:
                record = json.loads(raw)
                step = int(record["step"])
            except (ValueError, KeyError, TypeError, UnicodeDecodeError):
                dropped += bool(raw.strip())  # a torn line of a killed run
                continue
            if resume_step is not None and step <= resume_step:
                kept.append(raw if raw.endswith(b"\n") else raw + b"\n")
            else:
                dropped += 1
    if dropped:
        write_atomically(path, b"".join(kept))
    return dropped
