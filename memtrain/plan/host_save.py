"""Host memory of a checkpoint save, and the host bytes by kind (pinned, pageable, page cache).

A run saves every `train.save_every` steps and at the end (train/loop.py), through DeepSpeed's
`engine.save_checkpoint` (train/state/checkpoint.py). What DeepSpeed 0.19 does there (runtime/engine.py):

  model states file   `_save_checkpoint` builds {module: module_state_dict(), optimizer: (ZeRO-0 only) the
                      optimizer's state_dict(), ...} and, because torch.save keeps storage sharing, hands
                      torch.save `clone_tensors_for_torch_save(state)`: every tensor copied to the CPU at once,
                      before anything is written. The module state dict holds every weight as stored on this rank,
                      so ZeRO-0/1/2 copy the whole module, written by data-parallel rank 0 only; ZeRO-3's
                      partitioned parameters are empty placeholders there (nothing to copy). A model with frozen
                      parameters (LoRA, QLoRA, DoRA) is saved with exclude_frozen_parameters
                      (train/state/checkpoint.py): the frozen base is neither copied nor written, only the trained
                      weights and what bitsandbytes adds beside a quantised weight's packed codes (its scales:
                      ~1/64 byte per weight with nf4 and double quantisation; train/state/frozen_base.py).
  ZeRO optimizer file `_save_zero_checkpoint` passes the optimizer's state_dict() to torch.save as it is: tensors
                      already on the CPU are written in place and GPU ones are copied one storage at a time, so
                      the transient is the largest GPU storage (ZeRO-1/2: the flat fp32 partition of a group).

So a save holds, beside the training phase's host bytes: the module's saved weights (ZeRO-0/1/2), the GPU-resident
optimizer states (ZeRO-0), or one flat partition (ZeRO-1/2/3 with the optimizer on the GPU). Measured: the 7B
full fine-tune stepping paged 8-bit AdamW in backward peaked at 27.4 GiB of host memory machine-wide while saving
(benchmarks/host_memory.csv), 14.9 planned for training + 12.55 for its bf16 weights = 27.45. Its paged 8-bit
moments (12.6 GiB of CUDA unified memory, mostly on the host while training) added nothing measurable: the copy
reads them where they are, onto a card freed of activations; that part rests on this one measurement.

The files written go through the page cache: reclaimable, so reported apart and not part of the bytes that
must fit the host.
"""

from __future__ import annotations

from memtrain.dtypes import DTYPE_BYTES
from memtrain.plan.model_states import StateBytes
from memtrain.plan.params import ParamCounts
from memtrain.recipe.schema import Recipe


def saved_module_bytes(recipe: Recipe, counts: ParamCounts, states: StateBytes) -> int:
    """Bytes of the module state dict a save copies and writes on rank 0 (see the module's text): every weight, or
    with frozen parameters the trained ones and a quantised base's constants; nothing under ZeRO-3."""
    if recipe.zero_stage == 3:
        return 0
    if not counts.frozen:
        return states.gpu_params
    packed = counts.quantized if recipe.model.quant_type == "int8" else counts.quantized // 2  # codes: left out
    return counts.trainable * DTYPE_BYTES[recipe.precision.storage] + counts.quantized_bytes - packed


def checkpoint_save_bytes(recipe: Recipe, counts: ParamCounts, states: StateBytes) -> int:
    """Host bytes a checkpoint save adds on this node, beside the training phase's (see the module's text)."""
    stage, master = recipe.zero_stage, 4 if recipe.precision.master == "fp32" else 2
    module = saved_module_bytes(recipe, counts, states)  # rank 0's module state dict, copied to the CPU
    if stage == 0:
        # the optimizer's GPU states cloned beside it; paged states are read where they are (measured: nothing)
        return module + states.gpu_optimizer_states
    if recipe.offload.optimizer == "none":  # one flat fp32 partition at a time (torch.save's .cpu() per storage)
        world = recipe.hardware.world_size
        return module + counts.trainable // world * master
    return module


def checkpoint_file_bytes(recipe: Recipe, counts: ParamCounts, states: StateBytes) -> int:
    """What a checkpoint writes through the page cache on this node: the module state dict (ZeRO-0/1/2, rank 0;
    `saved_module_bytes`) and the optimizer's states on every tier (master weights and moments)."""
    module = saved_module_bytes(recipe, counts, states)
    return module + states.gpu_optimizer_states + states.host_optimizer_states + states.nvme_optimizer_states


# Host breakdown terms (planner._host_breakdown) by the memory that holds them: page-locked (pinned: the kernel
# cannot swap or reclaim it, and it counts against the lock limit) or pageable.
ALWAYS_PINNED = ("swap_buffers", "offloaded_activations", "offloaded_layer_inputs")
PINNED_WITH_PIN_MEMORY = ("params", "gradients", "staging_buffers")
# What the kernel and the driver keep for the page-locked pages (planner._host_breakdown prices it from the pinned
# terms): not page-locked itself, but no more swappable, so the kinds count it with the pinned bytes.
PINNED_OVERHEAD = "pinned_overhead"


def pinned_terms(recipe: Recipe) -> tuple[str, ...]:
    """The host breakdown's terms in page-locked memory for this recipe (host.py says which buffers DeepSpeed pins:
    ZeRO-1/2 pin the master weights, ZeRO-3 keeps them in plain memory)."""
    if not recipe.offload.pin_memory:
        return ALWAYS_PINNED
    master = ("master_weights",) if recipe.zero_stage < 3 else ()
    return ALWAYS_PINNED + PINNED_WITH_PIN_MEMORY + master


def pinned_term_bytes(recipe: Recipe, breakdown: dict[str, int]) -> int:
    """The bytes of the host breakdown's page-locked terms (`pinned_terms`), without their bookkeeping."""
    return sum(breakdown.get(key, 0) for key in pinned_terms(recipe))


def host_kinds(recipe: Recipe, breakdown: dict[str, int], save_bytes: int, file_bytes: int) -> dict[str, int]:
    """The host's peak bytes as pinned (with what the kernel keeps for those pages) and pageable, and the page cache a
    save fills (apart: reclaimable). breakdown: the training phase's terms; save_bytes: what a save adds (pageable:
    torch.save's CPU copies)."""
    pinned = pinned_term_bytes(recipe, breakdown) + breakdown.get(PINNED_OVERHEAD, 0)
    load_copy = breakdown.get("model_copy_at_load", 0)
    pageable = sum(breakdown.values()) - pinned - load_copy + max(load_copy, save_bytes)
    return {"pinned": pinned, "pageable": pageable, "page_cache": file_bytes if save_bytes or file_bytes else 0}
