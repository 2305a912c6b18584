"""device_idle: the GPU's busy time over the profiled steps of a Chrome trace, and its idle time by host phase."""

from __future__ import annotations

import json

import pytest

from memtrain.monitor.device_idle import BETWEEN, device_idle
from memtrain.monitor.profiler import TRACE_FILE, StepProfiler
from tests.monitor.test_profiler import _train


def _range(name: str, start: float, end: float, cat: str = "user_annotation") -> dict:
    """One complete event as torch.profiler's export writes it (microseconds)."""
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": start, "dur": end - start}


def _two_steps() -> dict:
    host = [
        _range("ProfilerStep#1", 0, 1000),
        _range("forward", 0, 300),
        _range("backward", 300, 800),
        _range("optimizer_step", 800, 980),  # 980-1000: between phases
        _range("ProfilerStep#2", 1000, 2000),
        _range("forward", 1000, 1300),
        _range("backward", 1300, 1950),
        _range("optimizer_step", 1950, 2000),
        _range("aten::mm", 10, 20, cat="cpu_op"),  # host work is not device work
    ]
    device = [
        _range("gemm", 10, 290, cat="kernel"),
        _range("gemm", 300, 790, cat="kernel"),
        _range("Memcpy HtoD", 600, 700, cat="gpu_memcpy"),  # overlaps the kernel above: counted once
        _range("adam", 820, 850, cat="kernel"),
        _range("gemm", 1000, 1900, cat="kernel"),
        _range("late", 2100, 2200, cat="kernel"),  # after the profiled steps
    ]
    return {"traceEvents": host + device + [{"ph": "i", "name": "marker", "ts": 5}]}


def test_busy_and_idle_time_by_the_phase_the_host_was_in():
    idle = device_idle(_two_steps())
    assert idle.span_s == pytest.approx(2000e-6)
    assert idle.busy_s == pytest.approx((280 + 490 + 30 + 900) * 1e-6)
    assert idle.idle_s == pytest.approx(300e-6)
    # forward: 0-10 and 290-300; backward: 790-800 and 1900-1950; optimizer_step: 800-820, 850-980 and 1950-2000
    expected = {"forward": 20, "backward": 60, "optimizer_step": 200, BETWEEN: 20}
    assert idle.idle_by_phase_s == pytest.approx({name: us * 1e-6 for name, us in expected.items()})
    assert sum(idle.idle_by_phase_s.values()) == pytest.approx(idle.idle_s)


def test_the_summary_line_names_the_longest_waits_first():
    assert device_idle(_two_steps()).describe().endswith("host was in: nowhere.")  # waits under half a millisecond
    slower = [{**e, "ts": e["ts"] * 1000, "dur": e.get("dur", 0) * 1000} for e in _two_steps()["traceEvents"]]
    line = device_idle({"traceEvents": slower}).describe()
    assert line.startswith("GPU busy 1.700 s of the 2.000 s profiled (85%); idle 0.300 s")
    assert "optimizer_step 0.200 s, backward 0.060 s, forward 0.020 s, between phases 0.020 s." in line


def test_a_trace_without_device_activity_or_steps_says_nothing():
    trace = _two_steps()
    host_only = {"traceEvents": [e for e in trace["traceEvents"] if e.get("cat") != "kernel"]}
    host_only["traceEvents"] = [e for e in host_only["traceEvents"] if e.get("cat") != "gpu_memcpy"]
    assert device_idle(host_only) is None
    assert device_idle({"traceEvents": [e for e in trace["traceEvents"] if "Step" not in e["name"]]}) is None


def test_a_cpu_profile_has_no_device_time(tmp_path):
    """A real torch.profiler trace of CPU steps: the steps are there, no kernel is, so no line about the GPU."""
    _train(StepProfiler(tmp_path, steps=1, device="cpu"), steps=3)
    trace = json.loads((tmp_path / TRACE_FILE).read_text())
    assert any(e.get("name", "").startswith("ProfilerStep#") for e in trace["traceEvents"])
    assert device_idle(trace) is None
