"""What a worker that ran out of memory, with other processes, tells the next attempt.

In backward its peers are waiting for it inside a gradient reduction: it can neither retry in place nor save (both
would need them), so it leaves this note in the run directory and ends with EXIT_RESTART. torchrun then stops
the others, and the launcher starts every process again from the last checkpoint. Each of them reads the note
and starts at the smaller micro-batch; the same size on every rank keeps their collectives paired. In a forward,
where steps are laid out packed and the samples left are too uneven to lay out in as many micro-batches on each
rank, every process writes the same note (whichever ends first, the note is there) and ends so.

The note applies to the attempt that resumes from `resume_step` only. The first checkpoint saved after it
carries the batch policy's state, and the note is removed then.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from memtrain.files import write_atomically

NOTE_FILE = "oom-restart.json"


class RestartEveryProcess(Exception):
    """Raised once the note is written, by the worker that ran out of memory in backward or by every worker after
    a forward's: it ends with EXIT_RESTART, saying `line` once."""

    def __init__(self, line: str):
        super().__init__(line)
        self.line = line


@dataclass(frozen=True)
class RestartNote:
    resume_step: int  # the checkpoint's step the next attempt starts from (0: the start of the run)
    oom_step: int  # the step that ran out of memory (0-based, as the loop counts)
    rank: int  # the process that ran out of memory (the lowest, where several did in one forward)
    failed_micro_batch: int
    micro_batch: int  # where the next attempt starts, on every rank
    error: str  # PyTorch's first line
    max_steps_left: int | None = None  # the next attempt's --max-steps: the same stop step (None: no --max-steps)
    # where it ran out: in backward (the next attempt records the OOM: the failed one could not), or in a forward
    # (recorded by the failed attempt, which shrank before it found the shares too uneven)
    in_backward: bool = True

    def applies_to(self, resumed_step: int) -> bool:
        return self.resume_step == resumed_step


def write_note(run_dir: Path, note: RestartNote) -> Path:
    path = run_dir / NOTE_FILE
    write_atomically(path, json.dumps(asdict(note), indent=2))
    return path


def read_note(run_dir: Path) -> RestartNote | None:
    """The note, or None when there is none (or it cannot be read: the attempt then starts as the checkpoint says,
    and an OOM there shrinks again)."""
    try:
        return RestartNote(**json.loads((run_dir / NOTE_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def remove_note(run_dir: Path) -> None:
    (run_dir / NOTE_FILE).unlink(missing_ok=True)
