"""Host memory of offloaded runs, buffer by buffer (memtrain.plan.host), against hand computations;
PyTorch's pinned-memory rounding (memtrain.train.pinned); the allocation patterns that set the
allocator slack; ZeRO-3's initialisation under zero.Init; and LoRA layers traced as they train."""

from __future__ import annotations

import pytest

from memtrain.plan.calibration import _slack_ratios, calibration
from memtrain.plan.host import offload_host_bytes
from memtrain.plan.params import count_parameters
from memtrain.plan.pinned import ROUND_THRESHOLD_BYTES, pinned_bytes
from memtrain.plan.planner import allocation_pattern, plan_recipe
from memtrain.recipe.schema import Model
from tests.conftest import lora_layer_saved_bytes
from tests.plan.test_planner import TINY_TOTAL, tiny

GiB = 1024**3


def pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@pytest.mark.parametrize("size", [1, 1000, 4096, 3 * 2**20 + 1, 4_400_000_000])
def test_pinned_blocks_round_to_a_power_of_two_unless_exact(size):
    assert pinned_bytes(size, exact=False) == pow2(size) >= size
    assert pinned_bytes(size, exact=True) == (size if size > ROUND_THRESHOLD_BYTES else pow2(size))
    assert pinned_bytes(4_400_000_000, exact=False) == 8 * GiB  # a 1.1B fp32 master copy


def test_zero2_cpu_offload_buffers_by_hand():
    counts = count_parameters(Model(preset="tiny"))
    n, largest = TINY_TOTAL, max(counts.trainable_numels)
    exact = offload_host_bytes(
        counts,
        stage=2,
        gpus=1,
        storage="bf16",
        master="fp32",
        optimizer_tier="cpu",
        params_tier="none",
        pin_memory=True,
        exact_pinned=True,
        accumulates=False,
    )
    pin = lambda size: pinned_bytes(size, True)  # noqa: E731
    assert exact == {
        "params": 0,
        "master_weights": pin(4 * n),
        "gradients": pin(4 * n),
        "optimizer_states": 8 * n,
        "staging_buffers": pin(2 * n) + pin(2 * largest),
        "pinning_copy": 0,
    }
    accumulating = offload_host_bytes(
        counts,
        stage=2,
        gpus=1,
        storage="bf16",
        master="fp32",
        optimizer_tier="cpu",
        params_tier="none",
        pin_memory=True,
        exact_pinned=True,
        accumulates=True,
    )
    per_tensor = sum(pin(2 * k) for k in counts.trainable_numels)
    assert accumulating["staging_buffers"] - exact["staging_buffers"] == per_tensor
    rounded = offload_host_bytes(
        counts,
        stage=2,
        gpus=1,
        storage="bf16",
        master="fp32",
        optimizer_tier="cpu",
        params_tier="none",
        pin_memory=True,
        exact_pinned=False,
        accumulates=False,
    )
    assert rounded["master_weights"] == pow2(4 * n) and rounded["optimizer_states"] == 8 * n  # moments are not pinned
    unpinned = offload_host_bytes(
        counts,
        stage=2,
        gpus=1,
        storage="bf16",
        master="fp32",
        optimizer_tier="cpu",
        params_tier="none",
        pin_memory=False,
        exact_pinned=False,
        accumulates=True,
    )
    assert unpinned["master_weights"] == 4 * n and unpinned["staging_buffers"] == 2 * n + 2 * largest + 2 * n
    # bf16 master weights and optimizer states: half of everything, and no separate accumulation buffers
    half = offload_host_bytes(
        counts,
        stage=2,
        gpus=1,
        storage="bf16",
        master="bf16",
        optimizer_tier="cpu",
        params_tier="none",
        pin_memory=True,
        exact_pinned=True,
        accumulates=True,
    )
    assert half["master_weights"] == pin(2 * n) and half["optimizer_states"] == 4 * n
    assert half["staging_buffers"] == exact["staging_buffers"]


def test_zero3_cpu_offload_buffers_by_hand():
    counts = count_parameters(Model(preset="tiny"))
    n = TINY_TOTAL
    host = offload_host_bytes(
        counts,
        stage=3,
        gpus=1,
        storage="bf16",
        master="fp32",
        optimizer_tier="cpu",
        params_tier="cpu",
        pin_memory=True,
        exact_pinned=False,
        accumulates=True,
    )
    init_partitions = sum(pow2(2 * k) for k in counts.tensor_numels)
    assert host["params"] == pow2(2 * n) + init_partitions
    assert host["master_weights"] == 4 * n  # a plain copy, not pinned
    assert host["gradients"] == pow2(2 * n) + pow2(4 * n)  # one sub-group: n < sub_group_size
    assert host["optimizer_states"] == 8 * n and host["staging_buffers"] == 0
    no_params = offload_host_bytes(
        counts,
        stage=3,
        gpus=1,
        storage="bf16",
        master="fp32",
        optimizer_tier="cpu",
        params_tier="none",
        pin_memory=True,
        exact_pinned=False,
        accumulates=True,
    )
    assert no_params["params"] == 0
    unpinned = offload_host_bytes(
        counts,
        stage=3,
        gpus=1,
        storage="bf16",
        master="fp32",
        optimizer_tier="cpu",
        params_tier="cpu",
        pin_memory=False,
        exact_pinned=False,
        accumulates=True,
    )
    assert unpinned["params"] == 2 * n  # the flat copy only: freed plain partitions are not kept


def test_plan_host_total_is_baseline_plus_buffers():
    plan = plan_recipe(tiny(overrides=["offload.optimizer=cpu"]).recipe, exact_pinned=False)
    cal = calibration("24GiB")
    assert plan.host_breakdown["baseline"] == cal.host_baseline_bytes
    assert plan.host_phases["training"] == sum(plan.host_breakdown.values())
    assert plan.host_bytes == max(plan.host_phases.values())  # a checkpoint save may be the peak (test_host_save.py)
    assert plan.host_breakdown["master_weights"] == pow2(4 * TINY_TOTAL)
    exact = plan_recipe(tiny(overrides=["offload.optimizer=cpu"]).recipe, exact_pinned=True)
    assert exact.host_bytes < plan.host_bytes  # the rounding threshold saves host memory, never costs it


def test_allocation_pattern_and_slack_ratios_from_a_profile():
    assert allocation_pattern(tiny().recipe, 2) == "full"
    assert allocation_pattern(tiny().recipe, 3) == "zero3"
    assert allocation_pattern(tiny(overrides=["model.lora.r=8"]).recipe, 2) == "frozen"
    defaults = calibration("24GiB").allocator_slack_ratios
    assert dict(_slack_ratios(0.3, defaults)) == {name: 0.3 for name, _ in defaults}
    assert dict(_slack_ratios({"zero3": 0.9}, defaults))["zero3"] == 0.9
    assert dict(_slack_ratios({"zero3": 0.9}, defaults))["full"] == dict(defaults)["full"]
    for expandable in (True, False):
        lora = plan_recipe(tiny(overrides=["model.lora.r=8", f"hardware.expandable_segments={expandable}"]).recipe)
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
    offloaded = plan_recipe(tiny(overrides=["offload.optimizer=cpu", "offload.params=cpu"]).recipe)
    counts = count_parameters(Model(preset="tiny"))
    assert offloaded.zero_stage == 3 and offloaded.params == 0
    assert offloaded.phases["init"] == counts.largest_tensor * 2
    zero2 = plan_recipe(tiny(overrides=["offload.optimizer=cpu"]).recipe)
    assert zero2.phases["init"] > TINY_TOTAL * 2  # the module plus DeepSpeed's flat copies


def test_lora_layer_trace_equals_real_saved_tensors_except_the_dropout_mask():
    """The planner traces a LoRA layer as it trains (frozen base, adapters in the compute dtype).
    On the CPU, dropout keeps its mask in the input dtype; the plan prices CUDA's bool mask instead."""
    from memtrain.plan.activations import trace_layer

    model = Model(preset="tiny", lora={"r": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]})
    tokens = 2 * 32
    trace = trace_layer(model, "bf16", 2, 32)
    dropout_elements = tokens * (256 + 256 + 688)  # the inputs of q_proj, v_proj, down_proj
    assert trace.full_bytes == lora_layer_saved_bytes(model, 2, 32) - dropout_elements * (2 - 1)
    plain = trace_layer(Model(preset="tiny"), "bf16", 2, 32)
    assert trace.full_bytes != plain.full_bytes  # frozen weights and adapters change what is kept


def test_eight_bit_adamw_states_are_a_byte_per_moment():
    """bitsandbytes' 8-bit AdamW: fp32 master copy (DeepSpeed's) + two one-byte moments with a scale per 256."""
    from memtrain.plan.model_states import optimizer_bytes_per_param

    assert optimizer_bytes_per_param("bf16", "fp32") == 12
    assert optimizer_bytes_per_param("bf16", "fp32", eight_bit=True) == 4 + 2 * (1 + 4 / 256)
    lora = ["model.lora.r=8"]
    full = plan_recipe(tiny(overrides=lora).recipe)
    eight = plan_recipe(tiny(overrides=[*lora, "optimizer.name=adamw_8bit"]).recipe)
    assert eight.optimizer_states == int(full.params_trainable * (4 + 2 * (1 + 4 / 256)))
    assert eight.optimizer_states < full.optimizer_states == full.params_trainable * 12


def test_a_fit_below_the_largest_measured_slack_is_tight_and_auto_does_not_take_it():
    from memtrain.commands.plan import verdict
    from memtrain.plan.planner import resolve_micro_batch

    loaded = tiny()
    plan = plan_recipe(loaded.recipe)
    cal = calibration("24GiB")
    assert plan.peak_reserved_high_bytes >= plan.peak_reserved_bytes
    if plan.peak_phase != "init":
        assert plan.peak_reserved_high_bytes >= int(
            plan.peak_allocated_bytes * (1 + cal.slack_ratio_high("full", True))
        )
    assert not plan.tight and "tight" not in verdict(plan)  # 24 GiB is far above both estimates
    # a card between the expected and the high estimate: fits, but tight
    squeezed = plan_recipe(loaded.recipe)
    squeezed.gpu_capacity_bytes = (plan.peak_reserved_bytes + plan.peak_reserved_high_bytes) // 2 + plan.cuda_context
    assert squeezed.fits and squeezed.tight and "tight" in verdict(squeezed)
    # micro_batch: auto only takes sizes that fit at the high slack
    auto = tiny(overrides=["batch.micro_batch=auto", "batch.global_batch=64"])
    chosen = resolve_micro_batch(auto.recipe, "24GiB")
    assert not plan_recipe(auto.recipe, "24GiB", micro_batch=chosen).tight


def test_largest_sub_group_follows_deepspeeds_grouping():
    from memtrain.plan.model_states import largest_sub_group

    # tensors join a group until it holds `size` or more; the rest form the last group
    assert largest_sub_group([4, 4, 4, 4, 1], 6) == 8  # [4, 4] [4, 4] [1]
    assert largest_sub_group([10, 1, 1], 6) == 10  # one tensor may exceed the size
    assert largest_sub_group([1, 2, 3], 100) == 6  # fewer elements than the size: one group
    assert largest_sub_group([3, 3, 3, 3, 3], 7) == 9  # [3, 3, 3] [3, 3]


def test_nvme_tiers_host_buffers_by_hand(tmp_path):
    """Optimizer states and parameters on NVMe: the flat compute-dtype gradient partition stays in host
    memory; four or more page-locked buffers of the largest sub-group in fp32 carry the optimizer's
    tensors; the parameters' writes go through one compute-dtype copy of that sub-group and
    `buffer_count` buffers of the largest tensor. The compiled config uses the same sub-group size."""
    from memtrain.ds_config.compiler import ds_config
    from memtrain.plan.model_states import largest_sub_group

    loaded = tiny(
        overrides=[
            "offload.optimizer=nvme",
            "offload.params=nvme",
            f"hardware.nvme_path={tmp_path}",
            "offload.buffer_count=3",
        ]
    )
    counts = count_parameters(loaded.recipe.model)
    sub_group_size = ds_config(loaded.recipe, 1)["zero_optimization"]["sub_group_size"]
    assert sub_group_size == 100_000_000
    sub_group = largest_sub_group(counts.trainable_numels, sub_group_size)
    assert sub_group == TINY_TOTAL  # the tiny preset is one sub-group
    host = plan_recipe(loaded.recipe, exact_pinned=False).host_breakdown
    assert host["gradients"] == pow2(2 * TINY_TOTAL)
    assert host["swap_buffers"] == 4 * sub_group * 4 + (sub_group + 3 * counts.largest_tensor) * 2
    assert host["master_weights"] == host["optimizer_states"] == 0  # on disk, not in host memory
    # initialisation pins the gradient partition from a plain zeroed buffer: both alive for a moment
    assert host["pinning_copy"] == 2 * TINY_TOTAL
    unpinned = plan_recipe(
        tiny(
            overrides=[
                "offload.optimizer=nvme",
                "offload.params=nvme",
                "offload.pin_memory=false",
                f"hardware.nvme_path={tmp_path}",
            ]
        ).recipe
    ).host_breakdown
    assert unpinned["pinning_copy"] == 0 and unpinned["gradients"] == 2 * TINY_TOTAL


def test_nvme_parameters_keep_two_layers_and_the_largest_tensor_on_the_gpu(tmp_path):
    """With parameters on NVMe the compiler releases each one right after use (reuse distance 0), so the
    GPU holds the layer in use, the next one and the largest tensor (gathered whole), not
    max_live_parameters' worth (the CPU tier)."""
    from memtrain.ds_config.compiler import ds_config
    from memtrain.plan.calibration import calibration as cal_of
    from memtrain.plan.planner import bucket_elements

    nvme = tiny(overrides=["offload.optimizer=nvme", "offload.params=nvme", f"hardware.nvme_path={tmp_path}"])
    cpu = tiny(overrides=["offload.optimizer=cpu", "offload.params=cpu"])
    assert ds_config(nvme.recipe, 1)["zero_optimization"]["stage3_max_reuse_distance"] == 0
    counts = count_parameters(nvme.recipe.model)
    reduce, _ = bucket_elements(nvme.recipe, counts.hidden_size)
    cal = cal_of(nvme.recipe.hardware.gpu)
    live = 2 * counts.largest_layer + counts.largest_tensor
    assert plan_recipe(nvme.recipe).deepspeed_buffers == int(reduce * 2 * cal.zero_bucket_factor) + live * 2
    assert plan_recipe(cpu.recipe).deepspeed_buffers == int(reduce * 2 * cal.zero_bucket_factor) + TINY_TOTAL * 2


def test_zero3_reserved_is_the_sum_of_each_streams_peak_by_hand():
    """Expandable segments: the compute stream's peak with its slack, plus the all-gather stream's live
    parameters and the reduce stream's copies of the largest gradient (10 bytes per element), each +3 %."""
    from memtrain.plan.logits import estimate_logits
    from memtrain.plan.planner import bucket_elements

    loaded = tiny(overrides=["offload.optimizer=cpu", "offload.params=cpu", "offload.max_live_parameters=300000"])
    plan = plan_recipe(loaded.recipe)
    counts = count_parameters(loaded.recipe.model)
    cal = calibration("24GiB")
    reduce, _ = bucket_elements(loaded.recipe, counts.hidden_size)
    assert counts.largest_tensor > reduce  # the embedding is reduced on its own
    gathered = (300_000 + counts.largest_layer) * 2
    large_gradient = counts.largest_tensor * 10  # bf16 copy + fp64 norm chunk (> the fp32 cast)
    compute = plan.phases[plan.peak_phase] - gathered
    logits = estimate_logits(256, 4096, "bf16", 2, 64, False, 1024, True)
    slack = max(
        int(compute * cal.slack_ratio("zero3", True)),
        int(cal.expandable_zero3_min_slack_loss_tensors * logits.loss_tensor_bytes),
    )
    side = int((gathered + large_gradient) * (1 + cal.expandable_side_stream_slack_ratio))
    assert plan.peak_reserved_bytes == compute + slack + side
    # the large gradient's copies are reserved on their stream, never counted as allocated
    assert plan.peak_allocated_bytes == plan.phases[plan.peak_phase] < plan.peak_reserved_bytes - large_gradient
    assert plan.terms["reduce_stream"] == large_gradient
    assert plan.terms["allocator_slack"] == plan.peak_reserved_bytes - plan.peak_allocated_bytes - large_gradient


@pytest.mark.parametrize("micro_batch, seq_len, chunked", [(1, 64, False), (16, 256, True)])
def test_zero3_backward_peak_is_the_loss_moment_or_a_layer_moment_by_hand(micro_batch, seq_len, chunked):
    """Expandable segments, ZeRO-3: backward peaks either in the loss's backward, beside the head's gradient
    and DeepSpeed's partitioned copy of it, or in a recomputed layer's backward beside that layer's
    gradients, whichever is larger (segments/peaks-*.json); with the caching allocator, layer + loss."""
    from memtrain.plan.activations import estimate_activations
    from memtrain.plan.logits import estimate_logits

    offload = [
        "offload.optimizer=cpu",
        "offload.params=cpu",
        "checkpointing.strategy=every_layer",
        f"precision.chunked_loss={str(chunked).lower()}",
        "precision.loss_chunk_tokens=64",
    ]
    expandable = tiny(overrides=offload, micro_batch=micro_batch, seq_len=seq_len)
    r = expandable.recipe
    counts = count_parameters(r.model)
    acts = estimate_activations(
        r.model, r.checkpointing, "bf16", micro_batch, seq_len, counts.num_layers, counts.layers_name
    )
    logits = estimate_logits(counts.hidden_size, counts.vocab_size, "bf16", micro_batch, seq_len, chunked, 64, True)
    loss_moment = logits.backward_bytes + 2 * counts.largest_tensor * 2
    layer_moment = acts.backward_extra_bytes + counts.largest_layer * 2
    plan = plan_recipe(expandable.recipe)
    assert (
        plan.phases["backward_start"] - plan.phases["forward_end"]
        == max(loss_moment, layer_moment) - logits.forward_bytes
    )
    caching = plan_recipe(
        tiny(
            overrides=offload + ["hardware.expandable_segments=false"], micro_batch=micro_batch, seq_len=seq_len
        ).recipe
    )
    assert (
        caching.phases["backward_start"] - caching.phases["forward_end"]
        == acts.backward_extra_bytes + logits.backward_bytes - logits.forward_bytes
    )
    # unchunked at 1 × 64 tokens the loss and the embedding's gradients win; chunked at 16 × 256 a layer's
    assert (loss_moment > layer_moment) == (micro_batch == 1)


def test_zero3_side_streams_only_with_expandable_segments_and_an_offloaded_optimizer():
    """PyTorch's caching allocator prices ZeRO-3 by one slack ratio over all allocated bytes; without an
    offloaded optimizer there is no host-bound copy of the largest gradient."""
    from memtrain.plan.planner import _buffers

    offload = ["offload.optimizer=cpu", "offload.params=cpu"]
    caching = plan_recipe(tiny(overrides=offload + ["hardware.expandable_segments=false"]).recipe)
    cal = calibration("24GiB")
    assert caching.peak_reserved_bytes == int(caching.peak_allocated_bytes * (1 + cal.slack_ratio("zero3")))
    loaded = tiny(overrides=offload)
    counts = count_parameters(loaded.recipe.model)
    assert _buffers(loaded.recipe, counts, 3, cal).large_gradient_bytes == counts.largest_tensor * 10
    on_gpu = tiny(overrides=["offload.optimizer=none", "offload.zero_stage=3"])
    assert _buffers(on_gpu.recipe, counts, 3, cal).large_gradient_bytes == 0


@pytest.mark.parametrize(
    "elements, master, expected_bytes",
    [
        (65_536_000, "fp32", 65_536_000 * 10),  # 1.1B embedding: bf16 copy + fp64 norm (> fp32 cast)
        (65_536_000, "bf16", 65_536_000 * 10),  # no cast, the norm still 8 bytes per element
        (544_997_376, "bf16", 544_997_376 * 2 + 250_000_000 * 8),  # Qwen2.5-7B: the norm goes 250M at a time
        (544_997_376, "fp32", 544_997_376 * (2 + 4)),  # ... and the fp32 cast is then the larger transient
    ],
)
def test_reduce_stream_copies_of_the_largest_gradient_follow_deepspeeds_steps(elements, master, expected_bytes):
    """stage3.py: a copy in the accumulation dtype (bf16), then the larger of the fp64 norm's chunk
    (250M elements at most) and the cast to the master dtype (none when that is bf16 too)."""
    from dataclasses import replace

    from memtrain.plan.planner import large_gradient_bytes

    loaded = tiny(overrides=["offload.optimizer=cpu", "offload.params=cpu", f"precision.master={master}"])
    counts = replace(count_parameters(loaded.recipe.model), largest_tensor=elements)
    assert large_gradient_bytes(loaded.recipe, counts, reduce_elements=1_000_000) == expected_bytes


def test_fewer_live_parameters_reserve_less_by_what_they_hold():
    plans = [
        plan_recipe(
            tiny(
                overrides=["offload.optimizer=cpu", "offload.params=cpu", f"offload.max_live_parameters={live}"]
            ).recipe
        )
        for live in (300_000, 1_200_000)
    ]
    held = (1_200_000 - 300_000) * 2
    growth = plans[1].peak_reserved_bytes - plans[0].peak_reserved_bytes
    assert held <= growth <= held * (1 + calibration("24GiB").expandable_side_stream_slack_ratio) + 1


def test_a_profile_value_that_is_not_a_number_names_its_file_and_key(tmp_path, monkeypatch):
    import memtrain.plan.calibration as calibration_module
    from memtrain.errors import UserError

    (tmp_path / "gpus").mkdir()
    (tmp_path / "gpus" / "rtx4090.yaml").write_text("zero_bucket_factor: lots\n")
    monkeypatch.setattr(calibration_module, "CONFIGS_DIR", tmp_path)
    with pytest.raises(UserError) as caught:
        calibration("rtx4090")
    text = str(caught.value)
    assert "zero_bucket_factor" in text and "'lots' is not a number" in text and "rtx4090.yaml" in text


def test_sub_groups_and_the_ones_a_partial_offload_keeps_on_the_gpu():
    from memtrain.plan.model_states import split_sub_groups, sub_groups

    def device_sub_groups(numels, size, ratio):
        return len(split_sub_groups(numels, size, ratio)[0])

    assert sub_groups([4, 4, 4, 4, 1], 6) == [8, 8, 1]
    assert sub_groups([], 6) == []
    # stage3.py: the first int((1 - ratio) × count) sub-groups stay on the GPU
    assert device_sub_groups([4, 4, 4, 4, 1], 6, 0.5) == 1
    assert device_sub_groups([4, 4, 4, 4, 1], 6, 0.3) == 2
    assert device_sub_groups([4, 4, 4, 4, 1], 6, 1.0) == 0
    assert split_sub_groups([4, 4, 4, 4, 1], 6, 0.3) == ([8, 8], [1])
    # a 7B model in sub-groups of 1e9 elements is 7 of them: a ratio of 0.9 would move none, hence
    # the compiler's 1e8 for a partial offload (55 sub-groups, as tensors overshoot the size; 5 on the GPU)
    counts = count_parameters(Model(preset="llama2-7b"))
    assert device_sub_groups(counts.trainable_numels, 1_000_000_000, 0.9) == 0
    assert len(sub_groups(counts.trainable_numels, 100_000_000)) == 55
    assert device_sub_groups(counts.trainable_numels, 100_000_000, 0.9) == 5


@pytest.mark.parametrize("pin", [True, False])
def test_partial_offload_moves_whole_sub_groups_from_the_host_to_the_gpu(pin):
    """ZeRO-3, optimizer on the CPU with bf16 master weights, ratio 0.9: the five sub-groups on the GPU take
    their master weights, both moments and their gradient buffer (2 + 4 + 2 bytes per element) off the
    host and onto the GPU; a pinned gradient buffer stays in PyTorch's host cache after its copy."""
    from memtrain.ds_config.compiler import ds_config
    from memtrain.plan.model_states import place_model_states, sub_groups

    base = [
        "model.preset=llama2-7b",
        "offload.optimizer=cpu",
        "offload.zero_stage=3",
        "precision.master=bf16",
        f"offload.pin_memory={str(pin).lower()}",
        "data.seq_len=1024",
        "batch.micro_batch=1",
    ]
    full, partial = tiny(overrides=base).recipe, tiny(overrides=[*base, "offload.ratio=0.9"]).recipe
    assert ds_config(partial, 1)["zero_optimization"]["sub_group_size"] == 100_000_000
    assert ds_config(partial, 1)["zero_optimization"]["offload_optimizer"]["ratio"] == 0.9
    counts = count_parameters(partial.model)
    on_gpu = sum(sub_groups(counts.trainable_numels, 100_000_000)[:5])

    def states(ratio):
        return place_model_states(
            counts,
            stage=3,
            gpus=1,
            compute="bf16",
            master="bf16",
            optimizer_tier="cpu",
            params_tier="none",
            ratio=ratio,
        )

    assert states(0.9).gpu_optimizer_states - states(1.0).gpu_optimizer_states == 6 * on_gpu
    assert states(0.9).gpu_gradients - states(1.0).gpu_gradients == 2 * on_gpu
    host_full = plan_recipe(full, exact_pinned=True).host_breakdown
    host_partial = plan_recipe(partial, exact_pinned=True).host_breakdown
    assert host_full["master_weights"] - host_partial["master_weights"] == 2 * on_gpu
    assert host_full["optimizer_states"] - host_partial["optimizer_states"] == 4 * on_gpu
    if pin:  # the 1e8-element sub-groups are pinned one by one: the full offload's are 1e9 elements
        assert host_partial["gradients"] == pinned_bytes(2 * counts.trainable, True) + sum(
            pinned_bytes(2 * s, True) for s in sub_groups(counts.trainable_numels, 100_000_000)
        )
    else:
        assert host_full["gradients"] - host_partial["gradients"] == 2 * on_gpu
