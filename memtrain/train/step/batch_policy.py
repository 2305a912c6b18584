"""Adaptive micro-batch policy: a pure state machine fed with measured peaks and OOMs.

The policy only chooses how many samples go into one forward/backward pass. The loop splits each
optimizer step's `per_rank_batch` samples into micro-batches of that size (the last one may be
smaller, see `split_samples`) and weighs each micro-batch's loss by its token count, so the global
batch, the learning-rate schedule and the gradient are those of the recipe whatever the policy does.

Rules (recipe `batch.adaptive`, the article's defaults):
- after `grow_after_steps` consecutive steps under `grow_below` × cap, grow ×`grow_factor`
  (floor, at least +1), but never to a size whose peak the online fit predicts above
  `shrink_above` × cap (with no prior and one observed size, at least one size up as a probe),
  never to or past a size that ran out of memory, and at most halfway up to it (bisection);
- a step above `shrink_above` × cap multiplies the size by `shrink_factor`;
- an OOM rolls back to the largest size below the failing one that completed steps, else shrinks
  by `shrink_factor`; K OOMs in a row at the minimum size raise `GiveUp`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from memtrain.errors import Problem, UserError
from memtrain.recipe.schema import Batch

REASONS = ("grow", "shrink", "oom", "rollback", "forecast")
_STATE_VERSION = 1


@dataclass(frozen=True)
class Decision:
    """A change (or, after an OOM at the minimum, a retry) of the micro-batch size."""

    old_micro_batch: int
    new_micro_batch: int
    reason: str  # one of REASONS


class GiveUp(UserError):
    """The run keeps running out of memory at the smallest micro-batch; the recipe must change."""

    def __init__(self, micro_batch: int, oom_count: int, cap_bytes: int):
        self.micro_batch = micro_batch
        self.oom_count = oom_count
        self.cap_bytes = cap_bytes
        super().__init__(
            Problem(
                f"out of memory {oom_count} times in a row at micro_batch {micro_batch}, the smallest "
                f"allowed, under a cap of {cap_bytes / 2**30:.2f} GiB; a smaller batch cannot help",
                key="batch.adaptive.min_micro_batch",
                hint="lower the memory one sample needs (checkpointing.strategy: every_layer, "
                "offload.optimizer: cpu, model.lora, a shorter data.seq_len) or use a larger card "
                "(hardware.gpu); `memtrain plan <recipe>` shows the peak by term and the cheapest change that fits",
            )
        )


def split_samples(per_rank_batch: int, micro_batch: int) -> list[int]:
    """Sizes of the micro-batches one optimizer step is cut into: full ones, then the remainder."""
    if per_rank_batch < 1 or micro_batch < 1:
        raise ValueError(f"per_rank_batch ({per_rank_batch}) and micro_batch ({micro_batch}) must be >= 1")
    full, rest = divmod(per_rank_batch, micro_batch)
    return [micro_batch] * full + ([rest] if rest else [])


def largest_micro_batch_within(a: float, b: float, budget_bytes: float, upper: int) -> int:
    """Largest micro-batch m in [0, upper] with a + b·m <= budget_bytes (0 when even m = 1 is over)."""
    if b <= 0:
        return upper if a <= budget_bytes else 0
    return max(0, min(upper, math.floor((budget_bytes - a) / b)))


class PeakFit:
    """Online least-squares fit peak_bytes = a + b · micro_batch from (micro_batch, peak) pairs.

    Until two distinct sizes are seen the slope is the prior's (else peak proportional to the size,
    an upper bound since a >= 0) and the intercept is fitted to the data.
    """

    def __init__(self, prior: tuple[float, float] | None = None):
        self.prior = prior
        self.count = 0
        self.sum_x = self.sum_y = self.sum_xx = self.sum_xy = 0.0
        self.sizes: set[int] = set()

    def observe(self, micro_batch: int, peak_bytes: float) -> None:
        self.count += 1
        self.sum_x += micro_batch
        self.sum_y += peak_bytes
        self.sum_xx += micro_batch * micro_batch
        self.sum_xy += micro_batch * peak_bytes
        self.sizes.add(micro_batch)

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b) in bytes and bytes per sample, or None with neither data nor prior."""
        if self.count == 0:
            return None if self.prior is None else (float(self.prior[0]), float(self.prior[1]))
        mean_x, mean_y = self.sum_x / self.count, self.sum_y / self.count
        slope = None
        if len(self.sizes) >= 2:
            var_x = self.sum_xx - self.count * mean_x * mean_x
            slope = (self.sum_xy - self.count * mean_x * mean_y) / var_x
        if slope is None or slope <= 0:
            # Memory cannot fall with more samples; a non-positive slope is noise between close sizes.
            slope = self.prior[1] if self.prior is not None and self.prior[1] > 0 else mean_y / mean_x
        return mean_y - slope * mean_x, slope

    def informed(self) -> bool:
        """Whether the slope comes from a prior or from two or more observed sizes."""
        return self.prior is not None or len(self.sizes) >= 2

    def predict(self, micro_batch: int) -> float | None:
        coefficients = self.coefficients()
        return None if coefficients is None else coefficients[0] + coefficients[1] * micro_batch

    def state_dict(self) -> dict:
        return {
            "prior": None if self.prior is None else list(self.prior),
            "count": self.count,
            "sums": [self.sum_x, self.sum_y, self.sum_xx, self.sum_xy],
            "sizes": sorted(self.sizes),
        }

    def load_state_dict(self, state: dict) -> None:
        self.prior = None if state["prior"] is None else tuple(state["prior"])
        self.count = int(state["count"])
        self.sum_x, self.sum_y, self.sum_xx, self.sum_xy = (float(v) for v in state["sums"])
        self.sizes = {int(s) for s in state["sizes"]}


class BatchPolicy:
    """Chooses the micro-batch from per-step peaks, forecasts and OOMs (see the module docstring).

    `cfg.policy == "fixed"` never grows or shrinks on peaks or forecasts, but still shrinks on an
    OOM: retrying the same samples in smaller pieces keeps the math and beats crashing.
    """

    def __init__(
        self,
        cfg: Batch,
        per_rank_batch: int,
        initial_micro_batch: int,
        cap_bytes: int,
        prior: tuple[float, float] | None = None,
    ):
        if per_rank_batch < 1 or initial_micro_batch < 1 or cap_bytes < 1:
            raise ValueError(
                f"per_rank_batch ({per_rank_batch}), initial_micro_batch ({initial_micro_batch}) "
                f"and cap_bytes ({cap_bytes}) must be >= 1"
            )
        self.cfg = cfg
        self.rules = cfg.adaptive
        self.per_rank_batch = per_rank_batch
        self.cap_bytes = cap_bytes
        self.max_size = min(per_rank_batch, self.rules.max_micro_batch)
        self.min_size = min(self.rules.min_micro_batch, self.max_size)
        self.adaptive = cfg.policy == "adaptive"
        low = self.min_size if self.adaptive else 1
        self.micro_batch = max(low, min(initial_micro_batch, self.max_size))
        self.fit = PeakFit(prior)
        self.streak = 0  # consecutive steps under grow_below at this size
        self.stable_sizes: set[int] = set()  # sizes that completed steps and lie below any OOM size
        self.oom_ceiling: int | None = None  # smallest size that ran out of memory: never reached again
        self.ooms_at_min = 0  # OOMs at the minimum since the last completed step

    # -- events -------------------------------------------------------------------------------

    def after_step(self, peak_bytes: int) -> Decision | None:
        """Record one completed optimizer step's peak reserved bytes; maybe grow or shrink."""
        self.fit.observe(self.micro_batch, peak_bytes)
        self.stable_sizes.add(self.micro_batch)
        self.ooms_at_min = 0
        if not self.adaptive:
            return None
        share = peak_bytes / self.cap_bytes
        if share > self.rules.shrink_above:
            return self._shrink("shrink")
        if share >= self.rules.grow_below:
            self.streak = 0
            return None
        self.streak += 1
        if self.streak < self.rules.grow_after_steps:
            return None
        return self._grow()

    def before_step(self, forecast_bytes: int | None) -> Decision | None:
        """Early warning: shrink (adaptive only) when the forecast peak crosses shrink_above × cap."""
        if not self.adaptive or forecast_bytes is None:
            return None
        if forecast_bytes <= self.rules.shrink_above * self.cap_bytes:
            return None
        return self._shrink("forecast")

    def on_oom(self) -> Decision:
        """An OOM at the current size: roll back to the last stable size below it, else shrink.

        At the minimum size the decision is a retry at the same size; the `max_oom_at_min`-th OOM
        in a row there raises `GiveUp`.
        """
        failed = self.micro_batch
        self.streak = 0
        self.oom_ceiling = failed if self.oom_ceiling is None else min(self.oom_ceiling, failed)
        self.stable_sizes = {size for size in self.stable_sizes if size < failed}
        if failed <= self.min_size:
            self.ooms_at_min += 1
            if self.ooms_at_min >= self.rules.max_oom_at_min:
                raise GiveUp(failed, self.ooms_at_min, self.cap_bytes)
            return Decision(failed, failed, "oom")
        if self.stable_sizes:
            return self._move(max(self.stable_sizes), "rollback")
        return self._move(max(self.min_size, math.floor(failed * self.rules.shrink_factor)), "oom")

    def restarted_after_oom(self, failed_micro_batch: int, micro_batch: int) -> None:
        """A new attempt after another process of the run ran out of memory in backward at `failed_micro_batch`
        (memtrain.train.state.restart_note): start at `micro_batch` at most, and never grow back to the size that
        failed."""
        self.oom_ceiling = failed_micro_batch if self.oom_ceiling is None else min(self.oom_ceiling, failed_micro_batch)
        self.stable_sizes = {size for size in self.stable_sizes if size < failed_micro_batch}
        self.micro_batch = min(self.micro_batch, micro_batch)
        self.streak = 0

    # -- what the loop may read --------------------------------------------------------------

    def predicted_peak_bytes(self, micro_batch: int | None = None) -> float | None:
        """The fit's peak at `micro_batch` (default: the current size), or None with no data or prior."""
        return self.fit.predict(self.micro_batch if micro_batch is None else micro_batch)

    def micro_batch_sizes(self) -> list[int]:
        """How the next optimizer step's samples are cut at the current size."""
        return split_samples(self.per_rank_batch, self.micro_batch)

    # -- transitions ---------------------------------------------------------------------------

    def _grow(self) -> Decision | None:
        target = max(self.micro_batch + 1, math.floor(self.micro_batch * self.rules.grow_factor))
        upper = self.max_size
        if self.oom_ceiling is not None:
            upper = min(upper, self.oom_ceiling - 1)
            # Bisect between this (stable) size and the OOM: a failed probe costs a retried step.
            target = min(target, self.micro_batch + max(1, (self.oom_ceiling - self.micro_batch) // 2))
        target = min(target, upper)
        coefficients = self.fit.coefficients()
        if coefficients is not None:
            budget_bytes = self.rules.shrink_above * self.cap_bytes
            fitting = largest_micro_batch_within(*coefficients, budget_bytes, upper)
            # One size and no prior is no slope: the proportional bound is too strict to refuse
            # on, so probe one size up (an OOM there rolls back here) and fit two points after.
            target = min(target, fitting if self.fit.informed() else max(fitting, self.micro_batch + 1))
        if target <= self.micro_batch:
            return None
        return self._move(target, "grow")

    def _shrink(self, reason: str) -> Decision | None:
        target = max(self.min_size, math.floor(self.micro_batch * self.rules.shrink_factor))
        if target >= self.micro_batch:
            self.streak = 0
            return None
        return self._move(target, reason)

    def _move(self, new_micro_batch: int, reason: str) -> Decision:
        decision = Decision(self.micro_batch, new_micro_batch, reason)
        self.micro_batch = new_micro_batch
        self.streak = 0
        return decision

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything that decides future moves, as plain JSON-able data."""
        return {
            "version": _STATE_VERSION,
            "micro_batch": self.micro_batch,
            "streak": self.streak,
            "stable_sizes": sorted(self.stable_sizes),
            "oom_ceiling": self.oom_ceiling,
            "ooms_at_min": self.ooms_at_min,
            "fit": self.fit.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output; the size is clamped to this run's limits."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"batch policy state version {state.get('version')!r}, expected {_STATE_VERSION}")
        low = self.min_size if self.adaptive else 1
        self.micro_batch = max(low, min(int(state["micro_batch"]), self.max_size))
        self.streak = int(state["streak"])
        self.stable_sizes = {int(s) for s in state["stable_sizes"]}
        self.oom_ceiling = None if state["oom_ceiling"] is None else int(state["oom_ceiling"])
        self.ooms_at_min = int(state["ooms_at_min"])
        self.fit.load_state_dict(state["fit"])
