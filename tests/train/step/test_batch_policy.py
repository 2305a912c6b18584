"""The adaptive batch policy as a pure state machine: table-driven rules, limits, OOMs, checkpoints."""

from __future__ import annotations

import json
import random

import pytest

from memtrain.errors import UserError
from memtrain.recipe.schema import Adaptive, Batch
from memtrain.train.step.batch_policy import BatchPolicy, GiveUp, PeakFit, split_samples

CAP = 1000  # bytes; peaks below are shares of it ×1000, so 650 means 65 % of the card
LOW = 100  # well under grow_below (70 %) and far from any fit limit


def make(initial=4, per_rank_batch=64, policy="adaptive", prior=None, **rules) -> BatchPolicy:
    cfg = Batch(global_batch=per_rank_batch, micro_batch=initial, policy=policy, adaptive=Adaptive(**rules))
    return BatchPolicy(cfg, per_rank_batch=per_rank_batch, initial_micro_batch=initial, cap_bytes=CAP, prior=prior)


def play(policy: BatchPolicy, events):
    """Feed events ('s', peak) step / ('o',) OOM / ('f', bytes) forecast; return the decisions as tuples."""
    out = []
    for event in events:
        if event[0] == "s":
            decision = policy.after_step(event[1])
        elif event[0] == "o":
            decision = policy.on_oom()
        else:
            decision = policy.before_step(event[1])
        out.append(None if decision is None else (decision.old_micro_batch, decision.new_micro_batch, decision.reason))
    return out


def steps(peak, n):
    return [("s", peak)] * n


G = "grow"
CASES = {
    # name: (policy kwargs, events, expected decisions (None = no change))
    "grows after exactly 5 steps under 70%": ({}, steps(LOW, 5), [None] * 4 + [(4, 6, G)]),
    "does not grow after 4": ({}, steps(LOW, 4), [None] * 4),
    "a step at 70% resets the streak": ({}, steps(LOW, 4) + steps(700, 1) + steps(LOW, 5), [None] * 9 + [(4, 6, G)]),
    "a step at 80% resets the streak": ({}, steps(LOW, 3) + steps(800, 1) + steps(LOW, 4), [None] * 8),
    "streak restarts at the new size": (
        {},
        steps(LOW, 5) + steps(LOW, 4) + steps(LOW, 1),
        [None] * 4 + [(4, 6, G)] + [None] * 4 + [(6, 9, G)],
    ),
    "shrinks above 90%": ({"initial": 8}, steps(901, 1), [(8, 4, "shrink")]),
    "exactly 90% does not shrink": ({"initial": 8}, steps(900, 1), [None]),
    "no shrink below the minimum": ({"initial": 1}, steps(990, 2), [None, None]),
    "shrink respects min_micro_batch": ({"initial": 6, "min_micro_batch": 4}, steps(950, 2), [(6, 4, "shrink"), None]),
    "custom grow_after_steps and factor": (
        {"grow_after_steps": 2, "grow_factor": 2.0},
        steps(LOW, 4),
        [None, (4, 8, G), None, (8, 16, G)],
    ),
    "OOM rolls back to the last stable size": (
        {},
        steps(LOW, 5) + steps(LOW, 1) + [("o",)],
        [None] * 4 + [(4, 6, G), None, (6, 4, "rollback")],
    ),
    "OOM before any stable size halves": ({"initial": 16}, [("o",), ("o",)], [(16, 8, "oom"), (8, 4, "oom")]),
    "OOM skips stable sizes at or above the failing one": (
        {"initial": 4, "grow_after_steps": 1},
        steps(LOW, 2) + [("f", 950)] + [("o",)],  # 4 -> 6 -> 9 (stable), forecast -> 4, OOM at 4: 9 is not below
        [(4, 6, G), (6, 9, G), (9, 4, "forecast"), (4, 2, "oom")],
    ),
    "never grows back into an OOM size": (
        {},
        steps(LOW, 5) + [("o",)] + steps(LOW, 5) + steps(LOW, 5),
        [None] * 4 + [(4, 6, G), (6, 4, "rollback")] + [None] * 4 + [(4, 5, G)] + [None] * 5,
    ),
    "max_micro_batch caps growth": (
        {"initial": 6, "max_micro_batch": 8},
        steps(LOW, 10),
        [None] * 4 + [(6, 8, G)] + [None] * 5,
    ),
    "per_rank_batch caps growth": (
        {"initial": 6, "per_rank_batch": 7},
        steps(LOW, 10),
        [None] * 4 + [(6, 7, G)] + [None] * 5,
    ),
    "forecast over 90% shrinks": (
        {"initial": 8},
        [("f", 950), ("f", 850), ("f", None)],
        [(8, 4, "forecast"), None, None],
    ),
    "OOM at the minimum retries at the minimum": (
        {"initial": 2},
        [("o",), ("o",), ("o",)],
        [(2, 1, "oom"), (1, 1, "oom"), (1, 1, "oom")],
    ),
    "a completed step resets the OOM count at the minimum": (
        {"initial": 1, "max_oom_at_min": 2},
        [("o",), ("s", LOW), ("o",), ("s", LOW), ("o",)],
        [(1, 1, "oom"), None, (1, 1, "oom"), None, (1, 1, "oom")],
    ),
    "fixed policy ignores peaks and forecasts": (
        {"initial": 8, "policy": "fixed"},
        steps(LOW, 10) + steps(990, 1) + [("f", 990)],
        [None] * 12,
    ),
    "fixed policy still shrinks on OOM, and stays there": (
        {"initial": 8, "policy": "fixed"},
        [("o",)] + steps(LOW, 6),
        [(8, 4, "oom")] + [None] * 6,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_rules(name):
    kwargs, events, expected = CASES[name]
    assert play(make(**kwargs), events) == expected


@pytest.mark.parametrize(("size", "grown"), [(1, 2), (2, 3), (3, 4), (4, 6), (5, 7), (7, 10), (10, 15), (11, 16)])
def test_growth_is_floor_of_one_and_a_half_and_at_least_one_more(size, grown):
    policy = make(initial=size, per_rank_batch=256)
    assert play(policy, steps(10, 5))[-1] == (size, grown, G)
    assert policy.micro_batch == grown


def test_initial_size_is_clamped_into_the_limits():
    assert make(initial=100, per_rank_batch=32).micro_batch == 32
    assert make(initial=100, max_micro_batch=16).micro_batch == 16
    assert make(initial=1, min_micro_batch=3).micro_batch == 3
    assert make(initial=5, min_micro_batch=8, per_rank_batch=6).micro_batch == 6  # min above per-rank batch


def test_a_restart_after_another_processs_oom_starts_smaller_and_never_grows_back_to_the_failed_size():
    """restart_note.py: the new attempt's policy comes from the checkpoint (size 8, stable), then hears that size 8
    ran out of memory in backward on another rank and that the attempt starts at 4."""
    policy = make(initial=8)
    for _ in range(10):
        policy.after_step(LOW)  # stable at 8, and it has grown since
    grown = policy.micro_batch
    assert grown > 8
    policy.restarted_after_oom(grown, 4)
    assert policy.micro_batch == 4 and policy.oom_ceiling == grown
    for _ in range(40):
        policy.after_step(LOW)
    assert 4 < policy.micro_batch < grown  # grows again, bisecting below the size that failed


def test_gives_up_after_k_ooms_at_the_minimum_with_a_message_that_says_what_to_change():
    policy = make(initial=4, max_oom_at_min=3)
    assert play(policy, [("o",)] * 4) == [(4, 2, "oom"), (2, 1, "oom"), (1, 1, "oom"), (1, 1, "oom")]
    with pytest.raises(GiveUp) as caught:
        policy.on_oom()
    error = caught.value
    assert isinstance(error, UserError) and error.oom_count == 3 and error.micro_batch == 1
    text = str(error)
    for needle in ("3 times", "micro_batch 1", "batch.adaptive.min_micro_batch", "checkpointing", "memtrain plan"):
        assert needle in text


def test_give_up_honours_max_oom_at_min_of_one():
    policy = make(initial=1, max_oom_at_min=1)
    with pytest.raises(GiveUp):
        policy.on_oom()


# -- the fit ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("prior_slope", "grown"), [(50, 12), (80, 11), (100, 10), (300, None)])
def test_fit_picks_the_largest_size_predicted_under_shrink_above(prior_slope, grown):
    # Observed 650 B at size 8; with the prior's slope b the fit predicts 650 + b·(m - 8), limit 900 B.
    policy = make(initial=8, prior=(0.0, float(prior_slope)))
    last = play(policy, steps(650, 5))[-1]
    assert last == (None if grown is None else (8, grown, G))


def test_the_observed_line_refines_the_prior_and_picks_the_grown_size():
    # Size 4 -> 500 B, size 6 -> 690 B: slope 95 B/sample, intercept 120 B. From 6, ×1.5 would be 9
    # (predicted 975 B); the fit picks 8 (predicted 880 B, the largest under 900 B).
    policy = make(initial=4, grow_after_steps=1, prior=(0.0, 1.0))
    assert play(policy, [("s", 500), ("s", 690), ("s", 880)]) == [(4, 6, G), (6, 8, G), None]
    a, b = policy.fit.coefficients()
    assert b == pytest.approx(95.0) and a == pytest.approx(120.0)
    assert policy.predicted_peak_bytes(9) == pytest.approx(975.0)


def test_growth_refused_when_the_observed_line_predicts_over_the_cap():
    # Size 2 -> 300 B, size 3 -> 610 B: slope 310 B/sample, so size 4 predicts 920 B > 900 B; 3 stays.
    policy = make(initial=2, grow_after_steps=1, prior=(0.0, 1.0))
    assert play(policy, [("s", 300), ("s", 610), ("s", 610), ("s", 610)]) == [(2, 3, G), None, None, None]
    assert policy.micro_batch == 3


def test_without_prior_one_size_is_read_as_proportional_which_over_predicts():
    # 400 B at size 4 read as 100 B/sample: 9 would predict 900 B (allowed), 6 is ×1.5.
    policy = make(initial=4, grow_after_steps=1)
    assert policy.fit.coefficients() is None
    assert play(policy, [("s", 400)]) == [(4, 6, G)]
    assert policy.fit.coefficients() == pytest.approx((0.0, 100.0))
    # 650 B at size 4 is 162.5 B/sample: 6 would predict 975 B, so the fit stops at 5 (812.5 B).
    policy = make(initial=4, grow_after_steps=1)
    assert play(policy, [("s", 650)]) == [(4, 5, G)]
    # 690 B at size 4 bounds even 5 over 900 B, but a bound is no slope: probe one size up.
    policy = make(initial=4, grow_after_steps=1)
    assert play(policy, [("s", 690)]) == [(4, 5, G)]
    # With a prior the same step is refused: the prior's slope says 5 predicts 990 B.
    policy = make(initial=4, grow_after_steps=1, prior=(0.0, 300.0))
    assert play(policy, [("s", 690)]) == [None]


def test_linear_fit_recovers_a_and_b_from_noisy_observations():
    rng = random.Random(7)
    a_true, b_true = 3.2 * 2**30, 0.45 * 2**30
    fit = PeakFit(prior=(1.0 * 2**30, 2.0 * 2**30))  # a bad prior is forgotten once data has two sizes
    for _ in range(400):
        size = rng.randint(1, 16)
        fit.observe(size, (a_true + b_true * size) * (1 + rng.gauss(0, 0.01)))
    a, b = fit.coefficients()
    assert b == pytest.approx(b_true, rel=0.02)
    assert a == pytest.approx(a_true, rel=0.03)


def test_split_samples_keeps_every_sample():
    assert split_samples(10, 4) == [4, 4, 2]
    assert split_samples(12, 4) == [4, 4, 4]
    assert split_samples(3, 8) == [3]
    for per_rank_batch in range(1, 40):
        for micro_batch in range(1, 45):
            sizes = split_samples(per_rank_batch, micro_batch)
            assert sum(sizes) == per_rank_batch and max(sizes) == min(micro_batch, per_rank_batch)
    with pytest.raises(ValueError):
        split_samples(8, 0)


def test_state_dict_round_trip_continues_identically():
    events = (
        steps(LOW, 6)
        + [("o",)]
        + steps(LOW, 7)
        + [("f", 950)]
        + steps(650, 3)
        + [("o",)] * 2
        + steps(LOW, 5)
        + steps(920, 1)
        + steps(LOW, 9)
        + [("o",)]
        + steps(LOW, 6)
    )
    for cut in range(len(events) + 1):
        straight = make(initial=8, prior=(0.0, 60.0))
        expected = play(straight, events)
        first = make(initial=8, prior=(0.0, 60.0))
        play(first, events[:cut])
        state = json.loads(json.dumps(first.state_dict()))  # checkpoints store it as JSON
        resumed = make(initial=3, prior=(0.0, 999.0))  # what the resumed run is built with does not matter
        resumed.load_state_dict(state)
        assert play(resumed, events[cut:]) == expected[cut:], f"cut at {cut}"
        assert resumed.state_dict() == straight.state_dict()
