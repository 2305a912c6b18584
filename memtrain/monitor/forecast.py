"""Early warning of an OOM: a linear trend over the last N per-step peaks, projected ahead.

A run whose peak creeps up (fragmentation, a growing cache, longer samples) is caught before the
allocator fails. The window only holds peaks measured at one micro-batch size: a size change makes
the old peaks meaningless for the new size, so `observe` starts a fresh window when it sees one.
"""

from __future__ import annotations

from collections import deque


class PeakForecast:
    """Sliding window of the last `window_steps` per-step peaks (bytes) and their linear trend."""

    def __init__(self, window_steps: int = 20, horizon_steps: int = 10, min_points: int = 3):
        if window_steps < 2 or horizon_steps < 0 or not 2 <= min_points <= window_steps:
            raise ValueError(
                f"need window_steps >= 2 ({window_steps}), horizon_steps >= 0 ({horizon_steps}) and "
                f"2 <= min_points <= window_steps ({min_points})"
            )
        self.window_steps = window_steps
        self.horizon_steps = horizon_steps
        self.min_points = min_points
        self.peaks: deque[float] = deque(maxlen=window_steps)
        self.micro_batch: int | None = None

    def observe(self, peak_bytes: int, micro_batch: int | None = None) -> None:
        """Add one optimizer step's peak; a new `micro_batch` (when given) starts a fresh window."""
        if micro_batch is not None and micro_batch != self.micro_batch:
            self.peaks.clear()
            self.micro_batch = micro_batch
        self.peaks.append(float(peak_bytes))

    def reset(self) -> None:
        """Forget all peaks (after an OOM or anything else that makes them stale)."""
        self.peaks.clear()
        self.micro_batch = None

    def trend(self) -> tuple[float, float] | None:
        """(bytes at the latest step, bytes per step) of the least-squares line; None below min_points."""
        count = len(self.peaks)
        if count < self.min_points:
            return None
        mean_x = (count - 1) / 2
        mean_y = sum(self.peaks) / count
        var_x = sum((x - mean_x) ** 2 for x in range(count))
        slope = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(self.peaks)) / var_x
        return mean_y + slope * (count - 1 - mean_x), slope

    def forecast(self, k_steps_ahead: int | None = None) -> int | None:
        """Peak bytes expected `k_steps_ahead` steps after the latest (default horizon_steps).

        With fewer than min_points peaks there is no trend: the largest one seen is the forecast.
        None before any peak.
        """
        if not self.peaks:
            return None
        k = self.horizon_steps if k_steps_ahead is None else k_steps_ahead
        line = self.trend()
        if line is None:
            return int(max(self.peaks))
        latest, slope = line
        return int(round(latest + slope * k))

    def warns(self, cap_bytes: int, threshold: float, k_steps_ahead: int | None = None) -> bool:
        """True when the forecast peak exceeds threshold × cap_bytes."""
        expected = self.forecast(k_steps_ahead)
        return expected is not None and expected > threshold * cap_bytes

    def state_dict(self) -> dict:
        return {"peaks": list(self.peaks), "micro_batch": self.micro_batch}

    def load_state_dict(self, state: dict) -> None:
        self.peaks = deque((float(p) for p in state["peaks"]), maxlen=self.window_steps)
        self.micro_batch = state["micro_batch"]
