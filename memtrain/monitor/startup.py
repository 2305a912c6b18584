"""Where the start of a run goes: seconds per phase from the process's start to the first optimizer step.

The clock's origin is the process's creation time (what `time to first step` has always been measured
from: psutil's create_time, the `process_started` of the run's start record), so the first phase holds the
interpreter's start and the imports. Each `mark(name)` gives the time since the previous mark to that
phase; the phases therefore sum to the first step's time exactly. The loop writes them as one `startup`
record of metrics.jsonl after the first step (scripts/bench_startup.py reads it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time

import psutil

# The phases in the order a run passes them; the record holds those that ran, and scripts/bench_startup.py keeps a
# column for each. With several processes the launcher's phases come first ("launch" to "plan", handed to the
# workers in CLOCK_ENV), then "workers" (torchrun and each worker's interpreter and imports), then the worker's own.
PHASES = (
    "launch",
    "load_recipe",
    "checks",
    "data",
    "plan",
    "workers",
    "process",
    "model",
    "cpu_adam_op",
    "deepspeed_init",
    "loaders",
    "loop_start",
    "eval_generate",
    "first_step",
)
CLOCK_ENV = "MEMTRAIN_STARTUP_CLOCK"  # the launcher's clock, for its workers (StartupClock.to_env / from_env)


class StartupClock:
    """Wall-clock seconds per start-up phase, in the order they ran (a phase marked twice adds up)."""

    def __init__(self, origin_s: float | None = None, now=time.time):
        self._now = now  # a test hook: a fake clock
        self.origin_s = psutil.Process().create_time() if origin_s is None else origin_s
        self._last_s = self.origin_s
        self.phases_s: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        """The phase `phase` ends now: the seconds since the previous mark are its."""
        now = self._now()
        self.phases_s[phase] = self.phases_s.get(phase, 0.0) + max(now - self._last_s, 0.0)
        self._last_s = now

    @property
    def elapsed_s(self) -> float:
        """Seconds from the origin to the last mark (the sum of the phases)."""
        return self._last_s - self.origin_s

    def to_env(self) -> str:
        """This clock for a process the launcher starts (CLOCK_ENV), which goes on from its last mark."""
        return json.dumps({"origin_s": self.origin_s, "last_s": self._last_s, "phases_s": self.phases_s})

    @classmethod
    def from_env(cls, text: str | None) -> "StartupClock":
        """The launcher's clock (CLOCK_ENV) with the time since its last mark as "workers" (torchrun and this
        worker's start); a clock from this process's start when there is none or it cannot be read."""
        clock = cls()
        try:
            launched = json.loads(text) if text else None
            origin_s, last_s = float(launched["origin_s"]), float(launched["last_s"])
            phases_s = {str(name): float(seconds) for name, seconds in launched["phases_s"].items()}
        except (ValueError, TypeError, KeyError):
            return clock
        clock.origin_s, clock._last_s, clock.phases_s = origin_s, last_s, phases_s
        clock.mark("workers")
        return clock

    def record(self) -> dict:
        """The `startup` record's fields: first_step_s and phases_s (rounded to milliseconds)."""
        return {
            "first_step_s": round(self.elapsed_s, 3),
            "phases_s": {name: round(seconds, 3) for name, seconds in self.phases_s.items()},
        }


# Measured on the GPU machine, whose image sets PYTHONDONTWRITEBYTECODE=1 and ships no bytecode: `import
# memtrain.commands.run` took 27.3 s compiling, 6.2-6.8 s once bytecode was kept
# (benchmarks/startup/imports-bytecode-gpu.txt).
HEAVY_PACKAGES = ("torch", "transformers")


def packages_without_bytecode(names: tuple[str, ...] = HEAVY_PACKAGES) -> list[str]:
    """Imported packages whose __init__ has no bytecode where this Python looks for it: they were compiled at this
    start and will be again at the next (PYTHONDONTWRITEBYTECODE, or a folder Python may not write to)."""
    missing = []
    for name in names:
        source = getattr(sys.modules.get(name), "__file__", None) or ""
        if not source.endswith(".py"):
            continue
        try:
            cached = importlib.util.cache_from_source(source)
        except NotImplementedError:  # an interpreter without bytecode caching
            continue
        if not os.path.exists(cached):
            missing.append(name)
    return missing


def bytecode_note(names: tuple[str, ...] = HEAVY_PACKAGES) -> str | None:
    """A line for people when the heavy packages are compiled again at every start, else None."""
    missing = packages_without_bytecode(names)
    if not missing:
        return None
    why = "PYTHONDONTWRITEBYTECODE is set" if sys.flags.dont_write_bytecode else "their folders are not writable"
    return (
        f"Python keeps no bytecode for {', '.join(missing)} here ({why}), so every start compiles them again "
        "(measured: 27 s instead of 6-7 s for memtrain's imports); unset PYTHONDONTWRITEBYTECODE, or set "
        "PYTHONPYCACHEPREFIX to a writable folder"
    )
