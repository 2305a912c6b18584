"""The start-up clock: each mark gives the time since the previous one to its phase, so they sum to the total."""
from __future__ import annotations

from memtrain.monitor.startup import StartupClock


def test_phases_sum_to_the_time_from_the_origin():
    ticks = iter([101.5, 104.0, 104.25, 110.0])
    clock = StartupClock(origin_s=100.0, now=lambda: next(ticks))
    for phase in ("launch", "model", "model", "first_step"):
        clock.mark(phase)
    assert clock.record() == {"first_step_s": 10.0, "phases_s": {"launch": 1.5, "model": 2.75, "first_step": 5.75}}
