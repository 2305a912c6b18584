"""Host memory of offloaded runs, buffer by buffer (memtrain.plan.host), against hand computations;
PyTorch's pinned-memory rounding (memtrain.train.pinned); the allocation patterns that set the
allocator slack; ZeRO-3's initialisation under zero.Init; and LoRA layers traced as they train."""
from __future__ import annotations

import pytest
import torch

from memtrain.plan.calibration import _slack_ratios, calibration
from memtrain.plan.host import offload_host_bytes
from memtrain.plan.params import count_parameters
from memtrain.plan.planner import allocation_pattern, plan_recipe
from memtrain.recipe.schema import Model
from memtrain.train.pinned import ROUND_THRESHOLD_BYTES, pinned_bytes

from .conftest import lora_layer_saved_bytes
from .test_plan import TINY_TOTAL, tiny

GiB = 1024**3


def pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@pytest.mark.parametrize("size", [1, 1000, 4096, 3 * 2**20 + 1, 4_400_000_000])
def test_pinned_blocks_round_to_a_power_of_two_unless_exact(size):
    assert pinned_bytes(size, exact=False) == pow2(size) >= size
    assert pinned_bytes(size, exact=True) == (size if size > ROUND_THRESHOLD_BYTES else pow2(size))
    assert pinned_bytes(4_400_000_000, exact=False) == 8 * GiB   # a 1.1B fp32 master copy


def test_zero2_cpu_offload_buffers_by_hand():
    counts = count_parameters(Model(preset="tiny"))
    n, largest = TINY_TOTAL, max(counts.trainable_numels)
    exact = offload_host_bytes(counts, 2, 1, "bf16", "fp32", "cpu", "none", pin_memory=True, exact_pinned=True,
                               accumulates=False)
    pin = lambda size: pinned_bytes(size, True)  # noqa: E731
    assert exact == {"params": 0, "master_weights": pin(4 * n), "gradients": pin(4 * n),
                     "optimizer_states": 8 * n, "staging_buffers": pin(2 * n) + pin(2 * largest)}
    accumulating = offload_host_bytes(counts, 2, 1, "bf16", "fp32", "cpu", "none", True, True, accumulates=True)
    per_tensor = sum(pin(2 * k) for k in counts.trainable_numels)
    assert accumulating["staging_buffers"] - exact["staging_buffers"] == per_tensor
    rounded = offload_host_bytes(counts, 2, 1, "bf16", "fp32", "cpu", "none", True, exact_pinned=False, accumulates=False)
    assert rounded["master_weights"] == pow2(4 * n) and rounded["optimizer_states"] == 8 * n  # moments are not pinned
    unpinned = offload_host_bytes(counts, 2, 1, "bf16", "fp32", "cpu", "none", pin_memory=False, exact_pinned=False,
                                  accumulates=True)
    assert unpinned["master_weights"] == 4 * n and unpinned["staging_buffers"] == 2 * n + 2 * largest + 2 * n
    # bf16 master weights and optimizer states: half of everything, and no separate accumulation buffers
    half = offload_host_bytes(counts, 2, 1, "bf16", "bf16", "cpu", "none", True, True, accumulates=True)
    assert half["master_weights"] == pin(2 * n) and half["optimizer_states"] == 4 * n
    assert half["staging_buffers"] == exact["staging_buffers"]


def test_zero3_cpu_offload_buffers_by_hand():
    counts = count_parameters(Model(preset="tiny"))
    n = TINY_TOTAL
    host = offload_host_bytes(counts, 3, 1, "bf16", "fp32", "cpu", "cpu", True, exact_pinned=False, accumulates=True)
    init_partitions = sum(pow2(2 * k) for k in counts.tensor_numels)
    assert host["params"] == pow2(2 * n) + init_partitions
    assert host["master_weights"] == 4 * n                        # a plain copy, not pinned
    assert host["gradients"] == pow2(2 * n) + pow2(4 * n)          # one sub-group: n < sub_group_size
    assert host["optimizer_states"] == 8 * n and host["staging_buffers"] == 0
    no_params = offload_host_bytes(counts, 3, 1, "bf16", "fp32", "cpu", "none", True, False, True)
    assert no_params["params"] == 0
    unpinned = offload_host_bytes(counts, 3, 1, "bf16", "fp32", "cpu", "cpu", False, False, True)
    assert unpinned["params"] == 2 * n   # the flat copy only: freed plain partitions are not kept


def test_plan_host_total_is_baseline_plus_buffers():
    plan = plan_recipe(tiny(overrides=["offload.optimizer=cpu"]), exact_pinned=False)
    cal = calibration("24GiB")
    assert plan.host_breakdown["baseline"] == cal.host_baseline_bytes
    assert plan.host_bytes == sum(plan.host_breakdown.values())
    assert plan.host_breakdown["master_weights"] == pow2(4 * TINY_TOTAL)
    exact = plan_recipe(tiny(overrides=["offload.optimizer=cpu"]), exact_pinned=True)
    assert exact.host_bytes < plan.host_bytes   # the rounding threshold saves host memory, never costs it


def test_allocation_pattern_and_slack_ratios_from_a_profile():
    assert allocation_pattern(tiny().recipe, 2) == "full"
    assert allocation_pattern(tiny().recipe, 3) == "zero3"
    assert allocation_pattern(tiny(overrides=["model.lora.r=8"]).recipe, 2) == "frozen"
    defaults = calibration("24GiB").allocator_slack_ratios
    assert dict(_slack_ratios(0.3, defaults)) == {name: 0.3 for name, _ in defaults}
    assert dict(_slack_ratios({"zero3": 0.9}, defaults))["zero3"] == 0.9
    assert dict(_slack_ratios({"zero3": 0.9}, defaults))["full"] == dict(defaults)["full"]
    for expandable in (True, False):
        lora = plan_recipe(tiny(overrides=["model.lora.r=8", f"hardware.expandable_segments={expandable}"]))
        ratio = calibration("24GiB").slack_ratio("frozen", expandable)
        if lora.peak_phase != "init":
            assert lora.peak_reserved_bytes == int(lora.peak_allocated_bytes * (1 + ratio))
    cal = calibration("24GiB")  # expandable segments leave less reserved-but-unused memory
    for pattern, _ in defaults:  # (QLoRA was not measured with them: its caching values stand)
        assert cal.slack_ratio(pattern, True) <= cal.slack_ratio(pattern)
    assert cal.slack_ratio("full", True) < cal.slack_ratio("full") / 5


def test_zero3_init_builds_one_tensor_at_a_time():
    """Under zero.Init each tensor is partitioned (or offloaded) as it is made: the init phase holds
    the GPU's share of the parameters and one whole tensor, never the whole module."""
    offloaded = plan_recipe(tiny(overrides=["offload.optimizer=cpu", "offload.params=cpu"]))
    counts = count_parameters(Model(preset="tiny"))
    assert offloaded.zero_stage == 3 and offloaded.params == 0
    assert offloaded.phases["init"] == counts.largest_tensor * 2
    zero2 = plan_recipe(tiny(overrides=["offload.optimizer=cpu"]))
    assert zero2.phases["init"] > TINY_TOTAL * 2   # the module plus DeepSpeed's flat copies


def test_lora_layer_trace_equals_real_saved_tensors_except_the_dropout_mask():
    """The planner traces a LoRA layer as it trains (frozen base, adapters in the compute dtype).
    On the CPU, dropout keeps its mask in the input dtype; the plan prices CUDA's bool mask instead."""
    from memtrain.plan.activations import trace_layer

    model = Model(preset="tiny", lora={"r": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]})
    tokens = 2 * 32
    trace = trace_layer(model, "bf16", 2, 32)
    dropout_elements = tokens * (256 + 256 + 688)     # the inputs of q_proj, v_proj, down_proj
    assert trace.full_bytes == lora_layer_saved_bytes(model, 2, 32) - dropout_elements * (2 - 1)
    plain = trace_layer(Model(preset="tiny"), "bf16", 2, 32)
    assert trace.full_bytes != plain.full_bytes   # frozen weights and adapters change what is kept


def test_eight_bit_adamw_states_are_a_byte_per_moment():
    """bitsandbytes' 8-bit AdamW: fp32 master copy (DeepSpeed's) + two one-byte moments with a scale per 256."""
    from memtrain.plan.model_states import optimizer_bytes_per_param

    assert optimizer_bytes_per_param("bf16", "fp32") == 12
    assert optimizer_bytes_per_param("bf16", "fp32", eight_bit=True) == 4 + 2 * (1 + 4 / 256)
    lora = ["model.lora.r=8"]
    full = plan_recipe(tiny(overrides=lora))
    eight = plan_recipe(tiny(overrides=[*lora, "optimizer.name=adamw_8bit"]))
    assert eight.optimizer_states == int(full.params_trainable * (4 + 2 * (1 + 4 / 256)))
    assert eight.optimizer_states < full.optimizer_states == full.params_trainable * 12


def test_a_fit_below_the_largest_measured_slack_is_tight_and_auto_does_not_take_it():
    from memtrain.plan.command import verdict
    from memtrain.plan.planner import resolve_micro_batch

    loaded = tiny()
    plan = plan_recipe(loaded)
    cal = calibration("24GiB")
    assert plan.peak_reserved_high_bytes >= plan.peak_reserved_bytes
    if plan.peak_phase != "init":
        assert plan.peak_reserved_high_bytes >= int(plan.peak_allocated_bytes * (1 + cal.slack_ratio_high("full", True)))
    assert not plan.tight and "tight" not in verdict(plan)  # 24 GiB is far above both estimates
    # a card between the expected and the high estimate: fits, but tight
    squeezed = plan_recipe(loaded)
    squeezed.gpu_capacity_bytes = (plan.peak_reserved_bytes + plan.peak_reserved_high_bytes) // 2 + plan.cuda_context
    assert squeezed.fits and squeezed.tight and "tight" in verdict(squeezed)
    # micro_batch: auto only takes sizes that fit at the high slack
    auto = tiny(overrides=["batch.micro_batch=auto", "batch.global_batch=64"])
    chosen = resolve_micro_batch(auto, "24GiB")
    assert not plan_recipe(auto, "24GiB", micro_batch=chosen).tight
