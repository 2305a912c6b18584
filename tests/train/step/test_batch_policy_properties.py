"""Properties of the batch policy over random event streams and simulated cards."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from memtrain.recipe.schema import Adaptive, Batch
from memtrain.train.step.batch_policy import BatchPolicy, GiveUp

GiB = 2**30
CAP = 24 * GiB

event = st.one_of(
    st.tuples(st.just("s"), st.floats(0.0, 1.3)),  # a step with peak = share × cap
    st.tuples(st.just("o")),  # an OOM
    st.tuples(st.just("f"), st.floats(0.0, 1.3)),  # a forecast
)


def make(initial, per_rank_batch, min_size, max_size, prior=None, policy="adaptive"):
    rules = Adaptive(min_micro_batch=min_size, max_micro_batch=max_size, max_oom_at_min=3)
    cfg = Batch(global_batch=per_rank_batch, micro_batch=initial, policy=policy, adaptive=rules)
    return BatchPolicy(cfg, per_rank_batch, initial, CAP, prior=prior)


@settings(max_examples=300, deadline=None)
@given(
    initial=st.integers(1, 300),
    per_rank_batch=st.integers(1, 300),
    min_size=st.integers(1, 8),
    max_size=st.integers(1, 300),
    policy=st.sampled_from(["adaptive", "fixed"]),
    events=st.lists(event, max_size=80),
)
def test_size_stays_in_limits_and_never_returns_to_an_oom_size(
    initial, per_rank_batch, min_size, max_size, policy, events
):
    batch_policy = make(initial, per_rank_batch, min_size, max_size, policy=policy)
    upper = min(per_rank_batch, max_size)
    smallest_oom = None
    for kind, *value in events:
        before = batch_policy.micro_batch
        try:
            if kind == "s":
                decision = batch_policy.after_step(int(value[0] * CAP))
            elif kind == "o":
                decision = batch_policy.on_oom()
                smallest_oom = before if smallest_oom is None else min(smallest_oom, before)
            else:
                decision = batch_policy.before_step(int(value[0] * CAP))
        except GiveUp:
            assert kind == "o" and before <= max(1, min(min_size, upper))
            return
        size = batch_policy.micro_batch
        assert 1 <= size <= upper
        if decision is not None:
            assert (decision.old_micro_batch, decision.new_micro_batch) == (before, size)
            grew = size > before
            assert grew == (decision.reason == "grow")
            if policy == "fixed":
                assert decision.reason in ("oom", "rollback")
        if smallest_oom is not None and size > before:
            assert size < smallest_oom, "grew into a size that ran out of memory"


@settings(max_examples=200, deadline=None)
@given(
    a_gib=st.floats(0.5, 12.0),
    b_gib=st.floats(0.02, 3.0),
    oom_share=st.floats(0.5, 1.0),
    initial=st.integers(1, 64),
    use_prior=st.booleans(),
)
def test_settles_without_crashing_on_a_simulated_card(a_gib, b_gib, oom_share, initial, use_prior):
    """The card's peak is a + b·m; allocations fail above oom_share × cap (fragmentation may make that
    lower than the 90 % the policy aims under). The policy must end on a size that runs, that is
    large enough (at 70 % or more, or the next size would be over 90 % or fail), after few OOMs."""
    a, b = a_gib * GiB, b_gib * GiB
    per_rank_batch = 64

    def peak(m):
        return a + b * m

    if peak(1) > oom_share * CAP:
        return  # nothing fits: covered by the GiveUp tests
    policy = make(initial, per_rank_batch, 1, 256, prior=(a, b) if use_prior else None)
    ooms = []
    for _ in range(200):
        m = policy.micro_batch
        if peak(m) > oom_share * CAP:
            ooms.append(m)
            policy.on_oom()
        else:
            policy.after_step(int(peak(m)))
    m = policy.micro_batch
    assert peak(m) <= oom_share * CAP and peak(m) <= 0.9 * CAP
    next_blocked = m == per_rank_batch or peak(m + 1) > 0.9 * CAP or any(s <= m + 1 for s in ooms)
    assert peak(m) >= 0.7 * CAP or next_blocked
    assert ooms == sorted(ooms, reverse=True) and len(set(ooms)) == len(ooms), "an OOM size was tried twice"
    assert len(ooms) <= 2 * 6, "halving down and bisecting up need at most 2·log2(64) failed probes"
    # The last 20 steps are quiet: the policy has settled.
    assert all(policy.after_step(int(peak(m))) is None for _ in range(20))
