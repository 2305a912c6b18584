"""Where the GPU waited in a profiled step: its busy time against the profiled span, and its idle time by the phase the
host was in meanwhile, read from the Chrome trace `memtrain run --profile N` writes.

A step that is short of the GPU's work is bound by the host: the time the GPU spends with nothing queued goes to
whatever the host was doing then (launching many small kernels, waiting on a `.item()`, Python between the phases).
The phases are the loop's ranges (memtrain.monitor.profiler.phase): forward, backward, optimizer_step, offload; a gap
in none of them is "between phases". Pure: reads a parsed trace, returns numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PHASES = ("forward", "backward", "optimizer_step", "offload")
BETWEEN = "between phases"
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
STEP_PREFIX = "ProfilerStep#"  # torch.profiler's range around each profiled step
US = 1e-6  # the trace's timestamps and durations are in microseconds


@dataclass(frozen=True)
class DeviceIdle:
    """Seconds over the profiled steps: their span on the host's clock, the GPU's busy time in it, and the rest by the
    host phase it fell in."""

    span_s: float
    busy_s: float
    idle_by_phase_s: dict[str, float] = field(default_factory=dict)

    @property
    def idle_s(self) -> float:
        return self.span_s - self.busy_s

    def describe(self) -> str:
        """One paragraph for profile_summary.txt."""
        share = self.busy_s / self.span_s if self.span_s else 0.0
        waits = sorted(self.idle_by_phase_s.items(), key=lambda kv: -kv[1])
        where = ", ".join(f"{name} {seconds:.3f} s" for name, seconds in waits if seconds >= 0.0005) or "nowhere"
        busy = f"GPU busy {self.busy_s:.3f} s of the {self.span_s:.3f} s profiled ({share:.0%})"
        return f"{busy}; idle {self.idle_s:.3f} s, by what the host was in: {where}."


def device_idle(trace: dict) -> DeviceIdle | None:
    """The GPU's busy and idle time over the trace's profiled steps; None without steps or device activity (a CPU
    run)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = _union((e["ts"], e["ts"] + e["dur"]) for e in events if str(e.get("name", "")).startswith(STEP_PREFIX))
    device = _union((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in DEVICE_CATEGORIES)
    if not steps or not device:
        return None
    phases = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"])
        for e in events
        if e.get("cat") == "user_annotation" and e.get("name") in PHASES
    )
    span = sum(end - start for start, end in steps)
    busy = sum(_overlap(interval, steps) for interval in device)
    idle: dict[str, float] = {}
    for gap in _gaps(steps, device):
        for name, seconds in _split_by_phase(gap, phases).items():
            idle[name] = idle.get(name, 0.0) + seconds
    return DeviceIdle(span_s=span * US, busy_s=busy * US, idle_by_phase_s=idle)


def _union(intervals) -> list[tuple[float, float]]:
    """Overlapping intervals merged, in order."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _overlap(interval: tuple[float, float], within: list[tuple[float, float]]) -> float:
    start, end = interval
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in within)


def _gaps(steps: list[tuple[float, float]], busy: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The stretches of the profiled steps in which the device ran nothing."""
    gaps = []
    for step_start, step_end in steps:
        cursor = step_start
        for start, end in busy:
            if end <= cursor or start >= step_end:
                continue
            if start > cursor:
                gaps.append((cursor, start))
            cursor = max(cursor, end)
        if cursor < step_end:
            gaps.append((cursor, step_end))
    return gaps


def _split_by_phase(gap: tuple[float, float], phases: list[tuple[float, float, str]]) -> dict[str, float]:
    """Seconds of `gap` under each host phase (the loop's phases do not nest), the rest between phases."""
    start, end = gap
    covered: dict[str, float] = {}
    inside = 0.0
    for a, b, name in phases:
        seconds = max(0.0, min(end, b) - max(start, a))
        if seconds:
            covered[name] = covered.get(name, 0.0) + seconds * US
            inside += seconds
    rest = (end - start) - inside
    if rest > 0:
        covered[BETWEEN] = covered.get(BETWEEN, 0.0) + rest * US
    return covered
