"""The LR schedule: warmup from the first update, decay to the floor, and DeepSpeed applies it."""

from __future__ import annotations

import math

import pytest
import torch

from memtrain.errors import UserError
from memtrain.recipe.schema import Recipe, Schedule
from memtrain.train.optim.schedule import lr_multiplier, lr_scheduler_factory
from memtrain.train.resolve import total_steps


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_warmup_starts_above_zero_and_reaches_the_peak(decay):
    schedule = Schedule(warmup_steps=4, decay=decay, min_lr_ratio=0.1)
    assert [lr_multiplier(s, schedule, 20) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_multiplier(4, schedule, 20) == pytest.approx(1.0)


def test_no_warmup_starts_at_the_peak():
    for decay in ("cosine", "linear", "constant"):
        assert lr_multiplier(0, Schedule(warmup_steps=0, decay=decay), 10) == 1.0


@pytest.mark.parametrize("decay,middle", [("cosine", 0.1 + 0.9 * 0.5), ("linear", 0.1 + 0.9 * 0.5), ("constant", 1.0)])
def test_decay_reaches_the_floor_at_the_end(decay, middle):
    schedule = Schedule(warmup_steps=0, decay=decay, min_lr_ratio=0.1)
    assert lr_multiplier(50, schedule, 100) == pytest.approx(middle)
    end = 1.0 if decay == "constant" else 0.1
    assert lr_multiplier(100, schedule, 100) == pytest.approx(end)
    values = [lr_multiplier(s, schedule, 100) for s in range(101)]
    assert all(b <= a + 1e-12 for a, b in zip(values, values[1:]))  # never rises after warmup


def test_cosine_shape():
    schedule = Schedule(warmup_steps=0, decay="cosine", min_lr_ratio=0.0)
    assert lr_multiplier(25, schedule, 100) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


def test_the_factory_drives_a_torch_optimizer_and_survives_a_state_dict_round_trip():
    schedule = Schedule(warmup_steps=2, decay="linear", min_lr_ratio=0.0)
    params = [torch.nn.Parameter(torch.zeros(1))]
    optimizer = torch.optim.SGD(params, lr=1.0)
    scheduler = lr_scheduler_factory(schedule, 6)(optimizer)
    seen = []
    for _ in range(4):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.5, 1.0, 1.0, 0.75])
    resumed_optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    resumed = lr_scheduler_factory(schedule, 6)(resumed_optimizer)
    resumed.load_state_dict(scheduler.state_dict())
    assert resumed.get_last_lr() == scheduler.get_last_lr() == pytest.approx([0.5])


def test_a_warmup_longer_than_an_epochs_run_is_refused_as_with_steps():
    """`train.steps=2` with 20 warmup steps is refused by the recipe's rules, but with train.epochs the
    warmup was cut to the run's 7 steps and the decay never came, without a word."""
    recipe = Recipe.model_validate(
        {
            "model": {"preset": "tiny"},
            "data": {"train": "builtin:shakespeare"},
            "batch": {"global_batch": 8, "micro_batch": 8},
            "schedule": {"warmup_steps": 20},
            "train": {"epochs": 1},
        }
    )
    assert total_steps(recipe, 160) == 20  # warmup as long as the run: allowed, as with train.steps
    with pytest.raises(UserError) as refused:
        total_steps(recipe, 56)
    [problem] = refused.value.problems
    assert problem.key == "schedule.warmup_steps" and problem.hint == "use at most 7 warmup steps"
    assert problem.message == (
        "warmup of 20 steps is longer than the whole run (7 steps: train.epochs 1 of 56 windows in batches of 8)"
    )
