"""The OOM early warning: trend over a sliding window of per-step peaks."""

from __future__ import annotations

import random

import pytest

from memtrain.monitor.forecast import PeakForecast

GiB = 2**30


def test_recovers_a_linear_creep_and_projects_it():
    forecast = PeakForecast(window_steps=20, horizon_steps=10)
    for step in range(50):
        forecast.observe(10 * GiB + step * 50 * 2**20)  # +50 MiB per step
    latest, slope = forecast.trend()
    assert slope == pytest.approx(50 * 2**20)
    assert latest == pytest.approx(10 * GiB + 49 * 50 * 2**20)
    assert forecast.forecast() == pytest.approx(10 * GiB + 59 * 50 * 2**20, abs=1)
    assert forecast.forecast(0) == pytest.approx(latest, abs=1)


def test_window_forgets_old_steps():
    forecast = PeakForecast(window_steps=5, horizon_steps=1)
    for peak in [100, 200, 300, 400, 500]:  # steep rise, then flat
        forecast.observe(peak * GiB)
    for _ in range(5):
        forecast.observe(20 * GiB)
    assert forecast.trend() == (pytest.approx(20 * GiB), pytest.approx(0.0))


def test_noisy_flat_series_does_not_warn_but_a_noisy_creep_does():
    rng = random.Random(3)
    cap = 24 * GiB
    flat, creeping = PeakForecast(), PeakForecast()
    for step in range(40):
        flat.observe(int(19 * GiB * (1 + rng.gauss(0, 0.01))))
        creeping.observe(int((17 * GiB + step * 0.08 * GiB) * (1 + rng.gauss(0, 0.01))))
    # flat: ~79 % of the card; creeping: ~20.1 GiB now (84 %), ~20.9 GiB in ten steps (87 %), 23 GiB in 35.
    assert not flat.warns(cap, 0.85)
    assert not creeping.warns(cap, 0.90)
    assert creeping.warns(cap, 0.85)
    assert creeping.warns(cap, 0.90, k_steps_ahead=35)
    assert flat.forecast(35) == pytest.approx(19 * GiB, rel=0.03)


def test_few_points_give_the_largest_seen_and_none_gives_none():
    forecast = PeakForecast(min_points=3)
    assert forecast.forecast() is None and not forecast.warns(1, 0.5)
    forecast.observe(5)
    forecast.observe(9)
    assert forecast.trend() is None and forecast.forecast() == 9
    forecast.observe(13)
    assert forecast.forecast(1) == 17


def test_a_new_micro_batch_starts_a_fresh_window():
    forecast = PeakForecast(window_steps=10, horizon_steps=5)
    for step in range(10):
        forecast.observe((16 + step * 0.5) * GiB, micro_batch=8)
    assert forecast.warns(24 * GiB, 0.9)
    forecast.observe(12 * GiB, micro_batch=4)  # shrunk: the old, rising peaks no longer apply
    assert forecast.forecast() == 12 * GiB and not forecast.warns(24 * GiB, 0.9)
    forecast.reset()
    assert forecast.forecast() is None


def test_state_dict_round_trip():
    forecast = PeakForecast(window_steps=4)
    for peak in [1, 4, 9, 16, 25]:
        forecast.observe(peak, micro_batch=2)
    restored = PeakForecast(window_steps=4)
    restored.load_state_dict(forecast.state_dict())
    assert restored.forecast(3) == forecast.forecast(3)
    forecast.observe(36, micro_batch=2)
    restored.observe(36, micro_batch=2)
    assert restored.forecast(3) == forecast.forecast(3) and restored.trend() == forecast.trend()


@pytest.mark.parametrize("kwargs", [{"window_steps": 1}, {"horizon_steps": -1}, {"min_points": 1}, {"min_points": 30}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        PeakForecast(**kwargs)
