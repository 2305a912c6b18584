"""The learning-rate schedule: linear warmup, then cosine / linear decay to min_lr_ratio, or constant.

A pure function of the optimizer step, handed to DeepSpeed as a LambdaLR. DeepSpeed's own
WarmupCosineLR / WarmupDecayLR were tried first: they need at least one warmup step, run the first
update at LR 0, and WarmupDecayLR decays between its warmup bounds rather than to a floor, so
"no warmup, linear decay" became a constant LR.
"""

from __future__ import annotations

import math

import torch

from memtrain.recipe.schema import Schedule


def lr_multiplier(step: int, schedule: Schedule, total_steps: int) -> float:
    """Share of the peak LR for the update made at optimizer step `step` (0-based)."""
    warmup = min(schedule.warmup_steps, total_steps)
    if step < warmup:
        return (step + 1) / warmup  # the first update already moves the weights
    if schedule.decay == "constant":
        return 1.0
    decay_steps = max(total_steps - warmup, 1)
    progress = min((step - warmup) / decay_steps, 1.0)
    floor = schedule.min_lr_ratio
    if schedule.decay == "cosine":
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return floor + (1 - floor) * (1 - progress)


def lr_scheduler_factory(schedule: Schedule, total_steps: int):
    """What deepspeed.initialize(lr_scheduler=...) takes: a callable from the optimizer to a scheduler."""

    def build(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, schedule, total_steps))

    return build
