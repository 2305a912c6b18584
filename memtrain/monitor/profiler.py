"""`memtrain run --profile N`: a torch.profiler Chrome trace of N optimizer steps, with named phases,
and a table of the operators that took the time (profile_summary.txt), headed on a GPU by how long the GPU waited and
in which phase (memtrain.monitor.device_idle).

The loop wraps its work in `phase("forward")`, `phase("backward")`, `phase("optimizer_step")`,
`phase("offload")`; while a profile is being recorded each becomes a record_function range (and an
NVTX range on CUDA, for Nsight Systems), so the overlap of compute and copies shows in the trace.
Outside a profile, and always with N == 0, `phase` returns one shared do-nothing context.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from memtrain.files import atomic_path, write_atomically
from memtrain.monitor.device_idle import device_idle

TRACE_FILE = "trace.json"
SUMMARY_FILE = "profile_summary.txt"  # the operators that took the time, as a table for people
SUMMARY_ROWS = 40
WARMUP_STEPS = 1

_NO_OP = contextlib.nullcontext()
_recording_on: torch.device | None = None  # the device of the StepProfiler recording now, if any


def phase(name: str):
    """A named range around one part of a step ("forward", "backward", "optimizer_step", "offload").

    A no-op unless a StepProfiler is recording.
    """
    if _recording_on is None:
        return _NO_OP
    return _ranges(name, _recording_on)


@contextlib.contextmanager
def _ranges(name: str, device: torch.device):
    with record_function(name):
        if device.type == "cuda":
            with torch.cuda.nvtx.range(name):
                yield
        else:
            yield


class StepProfiler:
    """Profiles `steps` optimizer steps after one warm-up step, then writes run_dir/trace.json.

    Use as a context around the training loop and call `step()` after every optimizer step. The trace is
    written when the last profiled step ends, or at exit if the run ends sooner. With steps == 0 nothing
    is recorded and every method is a cheap no-op.
    """

    def __init__(self, run_dir: Path, steps: int, device: torch.device | str):
        if steps < 0:
            raise ValueError(f"profile steps must be >= 0, got {steps}")
        self.trace_path = Path(run_dir) / TRACE_FILE
        self.steps = steps
        self.device = torch.device(device)
        self._profiler: profile | None = None
        self._steps_seen = 0

    @property
    def enabled(self) -> bool:
        """Whether this profiler records anything at all (steps > 0)."""
        return self.steps > 0

    @property
    def recording(self) -> bool:
        """Whether the torch profiler is running now (warm-up or active steps)."""
        return self._profiler is not None

    def __enter__(self) -> "StepProfiler":
        global _recording_on
        if not self.enabled:
            return self
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.trace_path.parent.mkdir(parents=True, exist_ok=True)
        self._profiler = profile(
            activities=activities,
            schedule=schedule(wait=0, warmup=WARMUP_STEPS, active=self.steps, repeat=1),
            on_trace_ready=self._write_trace,
            profile_memory=True,
        )
        self._profiler.__enter__()
        _recording_on = self.device
        return self

    def step(self) -> None:
        """Mark the end of one optimizer step; stops the profiler once the profiled steps are done."""
        if self._profiler is None:
            return
        self._steps_seen += 1
        self._profiler.step()
        if self._steps_seen >= WARMUP_STEPS + self.steps:
            self._stop()  # no profiler overhead for the rest of the run

    def __exit__(self, *exc_info) -> None:
        self._stop()

    def _stop(self) -> None:
        global _recording_on
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        _recording_on = None
        profiler.__exit__(None, None, None)

    def _write_trace(self, profiler: profile) -> None:
        with atomic_path(self.trace_path) as tmp:
            profiler.export_chrome_trace(str(tmp))
        self._write_summary(profiler)

    def _write_summary(self, profiler: profile) -> None:
        """run_dir/profile_summary.txt: the top operators and phases by device time (CPU time without a GPU),
        then by host time: where a step goes, without opening the trace."""
        events = profiler.key_averages()
        parts = [f"{self.steps} profiled step(s) after {WARMUP_STEPS} warm-up; times are totals over them.\n"]
        if self.device.type == "cuda":
            if (idle := device_idle(json.loads(self.trace_path.read_text()))) is not None:
                parts.append(idle.describe() + "\n")
            parts += ["By device time (self):", events.table(sort_by="self_cuda_time_total", row_limit=SUMMARY_ROWS)]
        parts += [
            "By host time (total, includes children):",
            events.table(sort_by="cpu_time_total", row_limit=SUMMARY_ROWS),
        ]
        write_atomically(self.trace_path.with_name(SUMMARY_FILE), "\n".join(parts))
