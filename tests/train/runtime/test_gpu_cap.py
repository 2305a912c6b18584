"""The emulated card's cap leaves the CUDA context outside the allocator, and the plan's verdict agrees with it."""

from __future__ import annotations

import pytest

from memtrain.configs import allocator_budget_bytes, gpu_profile
from memtrain.plan.planner import plan_recipe
from memtrain.recipe.load import load_recipe
from memtrain.train.runtime.distributed import gpu_cap
from memtrain.units import GiB

H200 = 143_771_058_176  # bytes torch reports for the H200's memory


def test_the_cap_leaves_the_target_cards_context_outside_the_allocators_share():
    profile = gpu_profile("rtx3090")
    fraction, cap = gpu_cap(profile, H200, cap_memory=True)
    assert cap == profile.memory_bytes - profile.cuda_context_bytes
    assert fraction == pytest.approx((profile.memory_bytes - profile.cuda_context_bytes) / H200)
    assert fraction * H200 + profile.cuda_context_bytes == pytest.approx(profile.memory_bytes)  # the card, not more
    assert gpu_cap(profile, H200, cap_memory=False) == (None, H200)
    assert gpu_cap(gpu_profile("24GiB"), 24 * GiB, cap_memory=True) == (None, 24 * GiB)  # the real card: no cap


def test_the_plans_verdict_and_the_cap_agree(write_recipe):
    recipe = load_recipe(write_recipe("cap")).recipe
    peak = plan_recipe(recipe).peak_reserved_bytes
    context = gpu_profile("24GiB").cuda_context_bytes  # a card given by size has the default context
    for card in (peak + context - 1, peak + context, peak + context + 1):
        plan = plan_recipe(
            recipe.model_copy(update={"hardware": recipe.hardware.model_copy(update={"gpu": str(card)})})
        )
        assert plan.peak_reserved_bytes == peak
        _, cap = gpu_cap(gpu_profile(str(card)), H200, cap_memory=True)
        assert plan.fits == (peak <= cap) == (card >= peak + context), card
        assert cap == allocator_budget_bytes(card, context)
