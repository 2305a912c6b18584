"""Test hooks, read from the environment once, at the edge, and handed down to the loop.

The default `Hooks()` does nothing. The environment variables (set by tests and by scripts that
study recovery) are:
  MEMTRAIN_INJECT_OOM            OOMs before chosen micro-batches' forward (or inside a decoder layer)
  MEMTRAIN_INJECT_OOM_BACKWARD   OOMs from inside chosen micro-batches' backward
  MEMTRAIN_INJECT_RANK           only this rank injects (default: every rank)
  MEMTRAIN_TRACE_SAMPLES         a file that receives the sample ids of every applied optimizer step
  MEMTRAIN_INJECT_NAN            steps whose loss (and gradients) become NaN, e.g. '3,4,5'
  MEMTRAIN_INJECT_OOM_EVAL       OOMs before chosen evaluation micro-batches (step:micro_index..., as above)
  MEMTRAIN_INJECT_ENOSPC         steps whose checkpoint save fails with "no space left on device"
  MEMTRAIN_INJECT_EROFS          steps whose checkpoint save fails with "read-only file system"
  MEMTRAIN_INJECT_SLOW_START     seconds to wait after deepspeed.initialize (with _RANK: one rank starts late)
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from memtrain.errors import Problem, UserError
from memtrain.train.runtime.oom import INJECT_ENV, OomInjector
from memtrain.train.state.storage import inject_write_error
from memtrain.train.step.guard import NAN_ENV, NanInjector

INJECT_BACKWARD_ENV = "MEMTRAIN_INJECT_OOM_BACKWARD"
INJECT_RANK_ENV = "MEMTRAIN_INJECT_RANK"
TRACE_ENV = "MEMTRAIN_TRACE_SAMPLES"
INJECT_EVAL_ENV = "MEMTRAIN_INJECT_OOM_EVAL"
INJECT_ENOSPC_ENV = "MEMTRAIN_INJECT_ENOSPC"
INJECT_EROFS_ENV = "MEMTRAIN_INJECT_EROFS"
INJECT_SLOW_START_ENV = "MEMTRAIN_INJECT_SLOW_START"


class SampleTrace:
    """The sample ids whose gradients went into each applied optimizer step, appended to a file
    (buffered until the step is applied, dropped when an OOM discards the step's gradients)."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else None
        self.pending: list[list[int]] = []

    def add(self, indices: list[int]) -> None:
        if self.path is not None:
            self.pending.append(list(indices))

    def discard(self) -> None:
        self.pending = []

    def commit(self, step: int, rank: int) -> None:
        if self.path is not None:
            with open(self.path, "a") as handle:
                for indices in self.pending:
                    handle.write(json.dumps({"step": step, "rank": rank, "indices": indices}) + "\n")
        self.pending = []


@dataclass
class Hooks:
    """What tests can make the loop do: injected OOMs and a trace of the samples trained on.

    One object per launch: a point that fired stays fired across a restart of the step.
    """

    oom: OomInjector = field(default_factory=OomInjector)
    oom_backward: OomInjector = field(default_factory=OomInjector)
    sample_trace: SampleTrace = field(default_factory=SampleTrace)
    nan: NanInjector = field(default_factory=NanInjector)
    oom_eval: OomInjector = field(default_factory=OomInjector)
    enospc_steps: frozenset[int] = frozenset()  # saves of these steps fail as if the disk were full
    erofs_steps: frozenset[int] = frozenset()  # saves of these steps fail as if the disk had turned read-only
    slow_start_s: float = 0.0  # waited after deepspeed.initialize: a rank still starting while the others train

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "Hooks":
        """Parse the environment once; a malformed injection spec is a UserError naming the variable."""
        only = environ.get(INJECT_RANK_ENV)
        injects = only is None or only == environ.get("RANK", "0")

        def injector(name: str) -> OomInjector:
            return OomInjector.parse(environ.get(name, ""), source=name) if injects else OomInjector()

        return cls(
            oom=injector(INJECT_ENV),
            oom_backward=injector(INJECT_BACKWARD_ENV),
            sample_trace=SampleTrace(environ.get(TRACE_ENV)),
            nan=NanInjector.parse(environ.get(NAN_ENV, "")) if injects else NanInjector(),
            oom_eval=injector(INJECT_EVAL_ENV),
            enospc_steps=_steps(environ.get(INJECT_ENOSPC_ENV, ""), INJECT_ENOSPC_ENV) if injects else frozenset(),
            erofs_steps=_steps(environ.get(INJECT_EROFS_ENV, ""), INJECT_EROFS_ENV) if injects else frozenset(),
            slow_start_s=_seconds(environ.get(INJECT_SLOW_START_ENV, ""), INJECT_SLOW_START_ENV) if injects else 0.0,
        )

    def save_fault(self, step: int) -> Callable[[Path], None] | None:
        """What the save of `step` fails with, half-way (checkpoint.save_checkpoint's `fault`), if anything."""
        if step in self.enospc_steps:
            return inject_write_error(errno.ENOSPC)
        if step in self.erofs_steps:
            return inject_write_error(errno.EROFS)
        return None

    def wait_slow_start(self) -> None:
        if self.slow_start_s > 0:
            time.sleep(self.slow_start_s)


def _seconds(spec: str, source: str) -> float:
    try:
        return float(spec) if spec.strip() else 0.0
    except ValueError:
        raise UserError(
            Problem(f"cannot read {spec!r} as seconds", key=source, hint="write a number of seconds, e.g. '30'")
        ) from None


def _steps(spec: str, source: str) -> frozenset[int]:
    try:
        return frozenset(int(part) for part in spec.split(",") if part.strip())
    except ValueError:
        raise UserError(
            Problem(
                f"cannot read {spec!r} as steps",
                key=source,
                hint="write the steps as numbers, comma-separated, e.g. '4,8'",
            )
        ) from None
