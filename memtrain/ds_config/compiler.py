"""Recipe -> DeepSpeed config. Pure functions: data in, dict out, no DeepSpeed import, no state changed.

What it decides:
- ZeRO stage from the offload tiers (parameters off the GPU need stage 3; otherwise stage 2).
- Accumulation: memtrain's loop owns the boundary, so the adaptive batch policy can change the
  micro-batch without changing the global batch. DeepSpeed stays in its managed mode and the loop
  marks each backward with `set_gradient_accumulation_boundary` (the last micro-batch of a step is
  the boundary). The unmanaged mode (`managed_gradient_accumulation: false`) does the same
  arithmetic but, with an offloaded optimizer, defers the boundary work to `step()`: every
  accumulated gradient goes back to the GPU and out again after the backward instead of during it
  (measured: 1.1B ZeRO-2 offload 2.2 s/step against 1.7). `train_micro_batch_size_per_gpu` and
  `gradient_accumulation_steps` describe the starting split, for DeepSpeed's bookkeeping.
- Bucket sizes from the model's hidden size (the rule HF's "auto" uses: hidden² for reduce
  buckets, 0.9·hidden² for ZeRO-3 prefetch, 10·hidden for the persistence threshold).
- The LR schedule is not in the config: memtrain hands DeepSpeed its own LambdaLR
  (`memtrain.train.optim.schedule`), whose state DeepSpeed checkpoints with the optimizer.
- Precision: DeepSpeed's bf16 / fp16 blocks (dynamic loss scaling for fp16); none with
  `optimizer.step_in_backward`, whose bf16 weights are their own master copy. Per-module fp32
  islands are applied to the model by `memtrain.model.precision`, not here.
- Activation checkpointing is applied to the model with non-reentrant torch.utils.checkpoint by
  `memtrain.model.recompute`; DeepSpeed's own `activation_checkpointing` block only configures
  its separate checkpointing API, which memtrain does not call, so it is not emitted.
"""

from __future__ import annotations

from memtrain.model.config import model_config
from memtrain.plan.model_states import sub_group_elements
from memtrain.plan.params import count_parameters
from memtrain.plan.zero import bucket_elements, grad_accum_steps, overlaps_comm
from memtrain.recipe.schema import Recipe

NEVER_PRINT = 2**31 - 1


def uses_client_optimizer(recipe: Recipe) -> bool:
    """Whether the optimizer is built outside DeepSpeed's config: a bitsandbytes one (8-bit / paged AdamW), or
    any stepped during backward (`optimizer.step_in_backward`)."""
    return recipe.optimizer.name != "adamw" or recipe.optimizer.step_in_backward


def _precision(recipe: Recipe) -> dict:
    p = recipe.precision
    config: dict = {}
    if recipe.optimizer.step_in_backward:
        # the bf16 weights are updated in place by the hooks (train/optim/in_backward.py): DeepSpeed's bf16 block would
        # wrap the optimizer in one that keeps fp32 master weights, the memory this mode exists to save
        return config
    if p.mode == "autocast":  # fp32 weights; DeepSpeed autocasts nn.Linear to bf16 and reduces their grads in bf16
        return {
            "torch_autocast": {
                "enabled": True,
                "dtype": "bfloat16",
                "lower_precision_safe_modules": ["torch.nn.Linear"],
            }
        }
    if p.compute == "bf16":
        bf16 = {"enabled": True}
        if p.master == "bf16":
            bf16.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
        config["bf16"] = bf16
    elif p.compute == "fp16":
        scale = p.loss_scale
        fp16 = {"enabled": True, "loss_scale": 0}
        if scale is not None:
            fp16.update(
                initial_scale_power=scale.initial_scale_power,
                loss_scale_window=scale.growth_interval,
                hysteresis=scale.hysteresis,
                min_loss_scale=scale.min_scale,
            )
        config["fp16"] = fp16
    return config


def _offload_block(tier: str, recipe: Recipe, params: bool, largest_param_numel: int) -> dict:
    o = recipe.offload
    block: dict = {"device": tier, "pin_memory": o.pin_memory}
    if tier == "nvme":
        block["nvme_path"] = recipe.hardware.nvme_path
        block["buffer_count"] = o.buffer_count if params else max(4, o.buffer_count)
    if params:
        if tier == "nvme":
            # Each swap buffer holds one whole parameter: the largest one (the embedding of a 7B Llama,
            # 131 M elements) must fit, or DeepSpeed stops at it ("More elements ... than buffer size").
            block["buffer_size"] = largest_param_numel
            # Every parameter on NVMe: DeepSpeed's default keeps the first 1e9 elements in host memory,
            # which the NVMe tier exists to avoid (and which left only a 1.1B model's last layers on disk).
            block["max_in_cpu"] = 0
    elif o.ratio < 1.0:
        block["ratio"] = o.ratio
    return block


def _zero(recipe: Recipe, hidden_size: int, largest_param_numel: int) -> dict:
    o = recipe.offload
    stage = recipe.zero_stage
    bucket, prefetch = bucket_elements(recipe, hidden_size)
    zero: dict = {"stage": stage}
    if stage == 0:
        return zero
    zero.update(
        overlap_comm=overlaps_comm(recipe) and stage >= 2,
        contiguous_gradients=True,
        reduce_bucket_size=bucket,
    )
    if stage in (1, 2):
        zero.update(allgather_bucket_size=bucket, reduce_scatter=True)
    if o.optimizer != "none":
        zero["offload_optimizer"] = _offload_block(
            o.optimizer, recipe, params=False, largest_param_numel=largest_param_numel
        )
    if stage == 3:
        zero.update(
            stage3_prefetch_bucket_size=prefetch,
            stage3_param_persistence_threshold=10 * hidden_size,
            stage3_max_live_parameters=o.max_live_parameters,
            stage3_max_reuse_distance=o.max_live_parameters,
            stage3_gather_16bit_weights_on_model_save=True,
            sub_group_size=sub_group_elements(o.optimizer, o.ratio),
        )
        if o.params != "none":
            zero["offload_param"] = _offload_block(
                o.params, recipe, params=True, largest_param_numel=largest_param_numel
            )
        if o.params == "nvme":
            # A parameter kept for reuse holds one of the `buffer_count` swap buffers until then. With the
            # default distance (1e9 elements) a checkpointed model keeps its last layers from forward to
            # backward, more parameters than buffers: DeepSpeed asserts "Not enough buffers 0 for swapping 1".
            # Released at once, they are read back from NVMe when backward needs them (prefetched).
            zero["stage3_max_reuse_distance"] = 0
    return zero


def _aio(recipe: Recipe) -> dict:
    a = recipe.offload.aio
    return {
        "block_size": a.block_size,
        "queue_depth": a.queue_depth,
        "intra_op_parallelism": a.intra_op_parallelism,
        "single_submit": a.single_submit,
        "overlap_events": a.overlap_events,
    }


def ds_config_for_shapes(
    recipe: Recipe, hidden_size: int, micro_batch: int, largest_param_numel: int = 100_000_000
) -> dict:
    """The DeepSpeed config for a recipe, given the model's shapes.

    hidden_size: the model's hidden size (bucket sizes derive from it).
    largest_param_numel: elements of the model's largest parameter (NVMe parameter swap buffers hold it).
    micro_batch: the resolved starting micro-batch (an int even when the recipe says "auto").

    An optimizer that stays on the device is torch's fused AdamW (`torch_adam`), not DeepSpeed's
    FusedAdam: the same single-kernel update, but nothing to JIT-compile at start-up (FusedAdam's
    nvcc build is most of the time to first step on a fresh machine), and it runs on the CPU
    accelerator too. Offloaded optimizers use DeepSpeed's CPU Adam, or with `offload.cpu_adam: torch` the same
    torch fused AdamW stepping on the CPU (nothing to build; DeepSpeed accepts it from its config's optimizer block,
    not as a client optimizer). The bitsandbytes optimizers
    (8-bit / paged AdamW) are built by the loop and handed to `deepspeed.initialize` as client
    optimizers, so the config has no "optimizer" block for them (`uses_client_optimizer`).
    """
    b, opt = recipe.batch, recipe.optimizer
    ranks = recipe.hardware.world_size  # every process of every node
    uses_nvme = "nvme" in (recipe.offload.optimizer, recipe.offload.params)
    optimizer_params = {"lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps, "weight_decay": opt.weight_decay}
    if recipe.offload.optimizer == "none" or recipe.offload.cpu_adam == "torch":
        optimizer_params.update(torch_adam=True, fused=True)
    accum = grad_accum_steps(b.global_batch, micro_batch, ranks)
    config = {
        "train_batch_size": micro_batch * accum * ranks,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": opt.grad_clip,
        "steps_per_print": NEVER_PRINT,
        "wall_clock_breakdown": False,
        **({} if uses_client_optimizer(recipe) else {"optimizer": {"type": "AdamW", "params": optimizer_params}}),
        **_precision(recipe),
        "zero_optimization": _zero(recipe, hidden_size, largest_param_numel),
        "zero_allow_untested_optimizer": True,
    }
    if uses_nvme:
        config["aio"] = _aio(recipe)
    return config


def ds_config(recipe: Recipe, micro_batch: int) -> dict:
    """The DeepSpeed config of a recipe at a starting micro-batch, with the model's shapes read from its
    config (preset or directory; no weights, nothing built but a cached meta model for the NVMe tier)."""
    hidden_size = model_config(recipe.model).hidden_size
    if recipe.offload.params != "nvme":
        return ds_config_for_shapes(recipe, hidden_size, micro_batch)
    # the same largest tensor the planner prices the swap buffers at (counted on the meta device, cached)
    largest = count_parameters(recipe.model).largest_tensor
    return ds_config_for_shapes(recipe, hidden_size, micro_batch, largest_param_numel=largest)
