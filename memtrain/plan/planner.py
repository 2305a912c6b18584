"""The memory plan of a recipe: terms per GPU, phase peaks, host and NVMe bytes, and the verdict.

The peak is the largest of four phases, not a sum of maxima:
  init           the module on the GPU plus what deepspeed.initialize builds beside it (ZeRO-1/2
                 flattens a second copy of the trainable parameters before freeing the first;
                 ZeRO-3 builds under zero.Init, so only one whole tensor exists at a time);
  forward_end    model states + DeepSpeed buffers + every saved activation + the loss forward;
  backward_start the same + the larger of one recomputed block with its gradient transients and the loss
                 backward (ZeRO-3 per stream: the loss backward with the head's gradient copies);
  optimizer_step model states + the step's transient (fp32 gradients, or buckets copied back).
A preference objective prices its micro-batch of pairs as twice the rows, and its reference's forward without
gradient as a fifth phase, reference_forward (plan/preference.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from transformers import PretrainedConfig

from memtrain.configs import allocator_budget_bytes
from memtrain.dtypes import DTYPE_BYTES
from memtrain.errors import Problem, RecipeError
from memtrain.model.attention import packs_samples, packs_steps, resolve_attention, with_attention
from memtrain.model.compiled import resolve_compile
from memtrain.model.config import model_architecture, model_config
from memtrain.model.kernels import uses_fused_loss
from memtrain.model.tiled_mlp import tile_count
from memtrain.model.varlen import ATTN_NAME as VARLEN
from memtrain.plan.activations import estimate_activations, trace_layer
from memtrain.plan.attention_backward import FLASH_KERNELS, flash_backward_bytes, sequences_in_micro_batch
from memtrain.plan.calibration import Calibration, calibration
from memtrain.plan.host import offload_host_bytes
from memtrain.plan.host_save import (
    PINNED_OVERHEAD,
    checkpoint_file_bytes,
    checkpoint_save_bytes,
    host_kinds,
    pinned_term_bytes,
)
from memtrain.plan.logits import estimate_fused_logits, estimate_logits
from memtrain.plan.model_states import StateBytes, master_bytes, place_model_states
from memtrain.plan.params import ParamCounts, count_parameters
from memtrain.plan.pinned import pinned_bytes
from memtrain.plan.preference import describe, preference_shape
from memtrain.plan.quantized import with_quantized_params
from memtrain.plan.zero import bucket_elements, grad_accum_steps, overlaps_comm
from memtrain.recipe.schema import Checkpointing, Recipe
from memtrain.units import GiB

TERMS = (
    "params",
    "gradients",
    "optimizer_states",
    "activations",
    "logits_loss",
    "deepspeed_buffers",
    "reduce_stream",
    "cuda_context",
    "allocator_slack",
)
PHASES = ("init", "forward_end", "backward_start", "optimizer_step")


@dataclass
class Plan:
    """Predicted memory of one recipe on one card. Bytes everywhere; GiB only when printed."""

    recipe_name: str
    gpu_name: str
    gpus: int
    zero_stage: int
    micro_batch: int
    seq_len: int
    params_total: int
    params_trainable: int
    terms: dict[str, int]  # per GPU, steady state (see TERMS)
    phases: dict[str, int]  # allocated bytes per GPU at each phase (see PHASES)
    peak_phase: str
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    gpu_capacity_bytes: int
    host_bytes: int
    host_breakdown: dict[str, int]  # the training phase's host bytes by what holds them
    host_capacity_bytes: int | None
    nvme_bytes: int
    nvme_breakdown: dict[str, int] = field(default_factory=dict)
    saved_for_backward: dict[str, int] = field(default_factory=dict)  # layers / head / loss, at the end of forward
    pinned_exact: bool = True  # pinned host buffers priced at their size (False: rounded to a power of two)
    peak_reserved_high_bytes: int = 0  # the peak at the largest allocator slack measured for this kind of run
    nodes: int = 1  # machines with `gpus` ranks each; host and NVMe bytes are each node's
    checkpointing: str = "every_layer"  # the strategy planned ('auto' shows as the first_n_layers it resolved to)
    recomputed_layers: int = 0  # whole decoder layers recomputed in backward
    inputs_on_host: bool = False  # the recomputed layers keep their inputs in host memory (offload_inputs)
    mlp_tiles: int | str = 0  # checkpointing.mlp_tiles planned (auto: it may have turned them on)
    compiled_layers: bool = False  # the decoder layers are compiled on a GPU (train.compile, auto resolved)
    preference: str = ""  # a preference objective's rows and reference, said (plan/preference.py); "" for SFT
    host_phases: dict[str, int] = field(default_factory=dict)  # training / checkpoint_save: host_bytes is the larger
    host_kinds: dict[str, int] = field(default_factory=dict)  # the peak's pinned and pageable bytes; page_cache apart
    # sequences a micro-batch's packed rows hold, as the attention backward is priced (0: rows are not packed for it)
    packed_sequences: int = 0
    packed_sequences_counted: bool = False  # counted in the data (run, plan --data), else assumed (attention_backward)

    @property
    def host_peak_phase(self) -> str:
        return max(self.host_phases, key=self.host_phases.__getitem__) if self.host_phases else "training"

    @property
    def gpu_required_bytes(self) -> int:
        """What the card must hold: the allocator's peak reserved memory plus the CUDA context."""
        return self.peak_reserved_bytes + self.terms["cuda_context"]

    @property
    def headroom_bytes(self) -> int:
        """Spare GPU bytes at the peak (negative: by how much it misses): the allocator's budget on the card
        (the emulated cap, memtrain.configs.allocator_budget_bytes) less the peak reserved."""
        return allocator_budget_bytes(self.gpu_capacity_bytes, self.terms["cuda_context"]) - self.peak_reserved_bytes

    @property
    def tight(self) -> bool:
        """Fits at the expected allocator slack, but not at the largest one measured for such runs."""
        return (
            self.headroom_bytes >= 0
            and self.peak_reserved_high_bytes + self.terms["cuda_context"] > self.gpu_capacity_bytes
        )

    @property
    def host_fits(self) -> bool:
        return self.host_capacity_bytes is None or self.host_bytes <= self.host_capacity_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0 and self.host_fits

    def __getattr__(self, name: str):
        # plan.params, plan.activations ... read the per-GPU terms; plan.init ... the phase peaks.
        terms, phases = self.__dict__.get("terms", {}), self.__dict__.get("phases", {})
        if name in terms:
            return terms[name]
        if name in phases:
            return phases[name]
        raise AttributeError(name)

    def to_json(self) -> dict:
        """A JSON-ready dict: every field plus the verdict."""
        data = asdict(self)
        data.update(
            fits=self.fits,
            tight=self.tight,
            host_fits=self.host_fits,
            headroom_bytes=self.headroom_bytes,
            gpu_required_bytes=self.gpu_required_bytes,
            host_peak_phase=self.host_peak_phase,
        )
        return data


def packed_attention_mask_bytes(recipe: Recipe, micro_batch: int) -> int:
    """Packed instruction and chat rows: transformers builds one (micro_batch, 1, seq, seq) mask that keeps each
    sample's attention to itself, shared by every layer and kept for backward (masking_utils, from the restarting
    position ids): bool for sdpa and flex attention, the compute dtype for eager. Flash attention and PyTorch's
    varlen kernel take the sample boundaries instead (model.attn_implementation auto resolved as on the recipe's
    CUDA card), and text windows need no mask."""
    if not packs_samples(recipe):
        return 0
    _, config = _on_card(recipe)
    attention = config._attn_implementation
    if attention.startswith("flash") or attention == VARLEN:
        return 0
    element_bytes = DTYPE_BYTES[recipe.precision.compute] if attention == "eager" else 1
    return micro_batch * recipe.data.seq_len * recipe.data.seq_len * element_bytes


def _on_card(recipe: Recipe) -> tuple[Recipe, PretrainedConfig]:
    """The recipe with model.attn_implementation resolved as the run resolves it on the recipe's CUDA card, and its
    model's config, whose _attn_implementation is the kernel the architecture then runs (Gemma-2: eager)."""
    resolved = with_attention(recipe, resolve_attention(recipe, varlen=True))
    return resolved, model_config(resolved.model)


def _attention_backward(
    recipe: Recipe, rows: int, rows_per_sample: int, densest_row_samples: int | None
) -> tuple[int, int]:
    """(what one FlashAttention-2 backward allocates (attention_backward.py) with the kernel the run resolves on the
    recipe's CUDA card, the sequences priced where they restart inside rows, else 0): sequences restart inside packed
    rows and laid-out-packed steps (varlen or flash); eager attention keeps its probabilities in the layer trace."""
    resolved, config = _on_card(recipe)
    attention = config._attn_implementation
    if attention not in FLASH_KERNELS:
        return 0, 0
    laid_out = packs_steps(resolved)  # varlen only
    restarts = laid_out or (attention != "sdpa" and packs_samples(recipe))
    seq_len = recipe.data.seq_len
    sequences = sequences_in_micro_batch(rows, seq_len, densest_row_samples, packed=restarts)
    if laid_out:  # a micro-batch laid out from one step's samples holds no more sequences than the step
        sequences = min(sequences, recipe.batch.global_batch // recipe.hardware.world_size * rows_per_sample)
    workspace = flash_backward_bytes(
        config,
        tokens=rows * seq_len,
        sequences=sequences,
        compute_bytes=DTYPE_BYTES[recipe.precision.compute],
    )
    return workspace, sequences if restarts else 0


def _head_bytes(counts: ParamCounts, compute_bytes: int, tokens: int) -> int:
    """Outside the layers: token ids kept by the embedding (int64) and the final norm (fp32 input copy,
    normalised and output in the compute dtype; the output is the lm_head / loss-chunk input)."""
    return tokens * 8 + tokens * counts.hidden_size * (4 + 2 * compute_bytes)


# A gradient larger than the reduce bucket (the embedding, the lm_head) is reduced and handed to the
# offloaded optimizer on its own, on ZeRO-3's reduce stream, through transient copies whose high-water mark
# that stream's segment keeps. DeepSpeed 0.19 (stage3.py partition_grads, _offload_grad_partition_at_boundary):
# the partition is copied into a GPU buffer in the accumulation dtype (the compute dtype: memtrain sets no
# data_types.grad_accum_dtype); its norm is taken in fp64, 250M elements at a time
# (_constant_buffered_norm2); then it is cast to the master dtype (no copy when that is the same dtype).
# Measured on the H200 (benchmarks/segments/*.json, bf16 compute, fp32 master): 0.61 and 0.95 GiB for the 1.1B
# and 3B embeddings, 10 bytes per element = 2 (bf16 copy) + max(8 (fp64 chunk), 4 (fp32 cast)). Qwen2.5-7B's
# 545M-element embedding with bf16 master weights is where the chunk and the missing cast matter (priced at
# 10 bytes per element it was over-predicted by 25.7 %).
NORM_CHUNK_ELEMENTS = 250_000_000
NORM_BYTES = 8  # fp64 on CUDA (deepspeed.runtime.zero.utils.get_norm_dtype)


def large_gradient_bytes(recipe: Recipe, counts: ParamCounts, reduce_elements: int) -> int:
    """ZeRO-3 with the optimizer offloaded: the reduce stream's transient for the largest gradient."""
    elements = counts.largest_tensor
    if recipe.offload.optimizer == "none" or elements <= reduce_elements:
        return 0
    accumulation_bytes = DTYPE_BYTES[recipe.precision.compute]
    master = master_bytes(recipe.precision.compute, recipe.precision.master)
    cast_bytes = elements * master if master != accumulation_bytes else 0
    norm_bytes = min(elements, NORM_CHUNK_ELEMENTS) * NORM_BYTES
    return elements * accumulation_bytes + max(norm_bytes, cast_bytes)


@dataclass(frozen=True)
class ZeroBuffers:
    """DeepSpeed's GPU buffers, by the CUDA stream that holds them."""

    reduce_bytes: int = 0  # reduce buckets, several alive with overlap_comm (compute stream)
    gathered_bytes: int = 0  # ZeRO-3: gathered parameters still resident (its all-gather stream)
    large_gradient_bytes: int = 0  # ZeRO-3, optimizer offloaded: see large_gradient_bytes (its reduce stream)

    @property
    def resident_bytes(self) -> int:
        """What stays allocated through forward and backward (the phases add it)."""
        return self.reduce_bytes + self.gathered_bytes

    @property
    def side_stream_bytes(self) -> int:
        """The high-water marks of ZeRO-3's all-gather and reduce streams."""
        return self.gathered_bytes + self.large_gradient_bytes


def whole_on_one_gpu(recipe: Recipe) -> bool:
    """ZeRO-3 on one GPU with the parameters on it: the partitions are the whole model, nothing is fetched
    from the host or another rank. Measured there (benchmarks/plan_accuracy.csv, the params-gpu and ratio0.9
    rows): gathered parameters stay a layer, and the side streams add no segments of their own (reserved
    was 0.2-0.9 GiB over allocated where the side-stream model priced 2.4-3.4)."""
    return recipe.zero_stage == 3 and recipe.offload.params == "none" and recipe.hardware.world_size == 1


def _buffers(recipe: Recipe, counts: ParamCounts, stage: int, cal: Calibration) -> ZeroBuffers:
    """DeepSpeed's GPU buffers: reduce buckets (several alive with overlap_comm), ZeRO-3's live parameters
    and its reduce stream's copies of the largest gradient."""
    if stage == 0:
        return ZeroBuffers()
    compute_bytes = DTYPE_BYTES[recipe.precision.compute]
    reduce, _ = bucket_elements(recipe, counts.hidden_size)
    if recipe.offload.optimizer == "none" and stage < 3:
        reduce = min(reduce, counts.trainable)
    factor = cal.zero_bucket_factor if overlaps_comm(recipe) else 1.0
    reduce_bytes = int(reduce * compute_bytes * factor)
    if stage < 3:
        return ZeroBuffers(reduce_bytes=reduce_bytes)
    if recipe.offload.params == "nvme":
        # released right after use (the compiler sets stage3_max_reuse_distance 0 for this tier): the layer
        # in use, the next one being fetched and the largest tensor, gathered whole (measured on the H200:
        # 1.1B, 0.28 GiB on the all-gather stream against 0.29 planned)
        live = 2 * counts.largest_layer + counts.largest_tensor
    elif whole_on_one_gpu(recipe):
        # only the layer in use and the largest tensor are gathered beside their partitions at the peak
        # (measured on the H200: 3B and 7B held 1.90 and 1.68 GiB less than the max_live_parameters term
        # below; fitted on those three rows, benchmarks/plan_accuracy.csv)
        live = counts.largest_layer + counts.largest_tensor
    else:
        # DeepSpeed releases gathered parameters only once more than max_live_parameters are resident,
        # so up to that many plus the layer being gathered stay on the GPU (measured on the H200:
        # 7B and 3B ZeRO-3 held 1.9 and 1.5 GiB more than one layer + one prefetch bucket).
        live = max(min(recipe.offload.max_live_parameters + counts.largest_layer, counts.total), counts.largest_tensor)
    return ZeroBuffers(
        reduce_bytes=reduce_bytes,
        gathered_bytes=live * compute_bytes,
        large_gradient_bytes=large_gradient_bytes(recipe, counts, reduce),
    )


def plan_recipe(
    recipe: Recipe,
    gpu: str | None = None,
    micro_batch: int | None = None,
    exact_pinned: bool = True,
    name: str = "recipe",
    densest_row_samples: int | None = None,
) -> Plan:
    """Predict the memory of a recipe on `gpu` (default: hardware.gpu) at `micro_batch`
    (default: the recipe's, with 'auto' resolved to the largest that fits). Pure: reads the recipe,
    memtrain's shipped profiles and the model's shapes (on the meta device), changes nothing.

    exact_pinned: whether pinned host buffers take their real size, as PyTorch >= 2.13 allocates them
    under the rounding threshold a run sets (memtrain.train.runtime.allocator); False prices PyTorch's
    power-of-two rounding, as older versions do. The run and `memtrain plan` pass what this PyTorch does.
    name: the recipe's name, for the plan's title.
    densest_row_samples: the most samples one row of the training data holds, where the caller has counted them
    (the variable-length attention's backward grows with them: attention_backward.py); else assumed.
    Raises RecipeError naming the key (not the file: the caller's Sources.locate adds file:line).
    """
    gpu = gpu or recipe.hardware.gpu
    try:
        cal = calibration(gpu)
    except ValueError:
        raise RecipeError(
            Problem(
                f"'{gpu}' is neither a GPU profile nor a size",
                key="hardware.gpu",
                hint="give a profile in configs/gpus or a size such as '24GiB'",
            )
        ) from None
    if micro_batch is None:
        micro_batch = (
            recipe.batch.micro_batch
            if recipe.batch.micro_batch != "auto"
            else resolve_micro_batch(recipe, gpu, exact_pinned, densest_row_samples)
        )
    counts = _counts(recipe)
    plan_at = functools.partial(
        _plan,
        name,
        counts=counts,
        cal=cal,
        micro_batch=micro_batch,
        exact_pinned=exact_pinned,
        densest_row_samples=densest_row_samples,
    )
    if recipe.checkpointing.strategy != "auto":
        return plan_at(recipe)
    on_gpu = _fewest_recomputed_layers(recipe, counts.num_layers, plan_at)
    # compiled layers cannot take the offload's saved-tensor hooks (recipe/rules.py refuses the pair)
    if _comfortable(on_gpu) or recipe.checkpointing.offload_inputs or resolve_compile(recipe, cuda=True):
        return on_gpu
    # Long sequences: the recomputed layers' inputs alone outgrow the card (16 GiB for Llama-3-8B at 65,536
    # tokens), so auto moves them to pinned host memory, and recomputes as few layers as fit then.
    on_host = _fewest_recomputed_layers(
        _with_first_n_layers(recipe, 0, inputs_on_host=True), counts.num_layers, plan_at
    )
    if _comfortable(on_host):
        return on_host
    candidates = [on_gpu, on_host]
    if tiles_may_help(recipe, counts.hidden_size):
        # Longer still: one recomputed layer's MLP intermediates (seq_len x intermediate_size each) dominate what
        # is left, so auto computes the MLPs in tiles too (mlp_tiles auto), at one more MLP forward a layer.
        tiled = _fewest_recomputed_layers(
            _with_first_n_layers(recipe, 0, inputs_on_host=True, mlp_tiles="auto"), counts.num_layers, plan_at
        )
        if _comfortable(tiled):
            return tiled
        candidates.append(tiled)
    # nothing fits comfortably: the cheapest that fits at all, else the plan without the host's copies
    return next((plan for plan in candidates if plan.fits), on_gpu)


def tiles_may_help(recipe: Recipe, hidden_size: int) -> bool:
    """Whether checkpointing auto may turn on tiled MLPs: not asked for already, the sequence longer than the
    hidden size (one tile otherwise), and nothing that refuses them (compiled layers, the optimizer stepped in
    backward: recipe/rules.py)."""
    return (
        recipe.checkpointing.mlp_tiles == 0
        and tile_count("auto", recipe.data.seq_len, hidden_size) > 0
        and not recipe.optimizer.step_in_backward
        and not resolve_compile(recipe, cuda=True)
    )


def _comfortable(plan: Plan) -> bool:
    return plan.fits and not plan.tight


def _with_first_n_layers(
    recipe: Recipe, layers: int, inputs_on_host: bool | None = None, mlp_tiles: int | str | None = None
) -> Recipe:
    update = {"strategy": "first_n_layers", "first_n_layers": layers}
    if inputs_on_host is not None:
        update["offload_inputs"] = inputs_on_host
    if mlp_tiles is not None:
        update["mlp_tiles"] = mlp_tiles
    return recipe.model_copy(update={"checkpointing": recipe.checkpointing.model_copy(update=update)})


def _fewest_recomputed_layers(recipe: Recipe, num_layers: int, plan_of: Callable[[Recipe], Plan]) -> Plan:
    """The plan of checkpointing 'auto': recompute the fewest decoder layers, from the first, whose plan
    fits without being tight. Memory falls as layers are added up to all but the last, so the search
    is a bisection there. The last layer is recomputed as soon as backward starts; that saves memory
    only when the loss's backward, which comes first, is larger than the layer (a large vocabulary,
    unchunked loss), so every layer is the answer only when it plans lower than all but the last,
    which does not fit comfortably. plan_of: the plan of a recipe (all else fixed)."""

    def plan_at(layers: int) -> Plan:
        return plan_of(_with_first_n_layers(recipe, layers))

    low, high = 0, max(num_layers - 1, 0)  # the answer lies in [low, high]
    while low < high:
        middle = (low + high) // 2
        plan = plan_at(middle)
        if plan.fits and not plan.tight:
            high = middle
        else:
            low = middle + 1
    best = plan_at(high)
    if not (best.fits and not best.tight) and num_layers > 0:
        every = plan_at(num_layers)
        if every.peak_reserved_bytes < best.peak_reserved_bytes:
            return every
    return best


def resolve_checkpointing(
    recipe: Recipe,
    micro_batch: int,
    gpu: str | None = None,
    exact_pinned: bool = True,
    densest_row_samples: int | None = None,
) -> Recipe:
    """The recipe with checkpointing 'auto' made concrete (first_n_layers) at this micro-batch."""
    if recipe.checkpointing.strategy != "auto":
        return recipe
    plan = plan_recipe(
        recipe, gpu, micro_batch=micro_batch, exact_pinned=exact_pinned, densest_row_samples=densest_row_samples
    )
    return _with_first_n_layers(
        recipe, plan.recomputed_layers, inputs_on_host=plan.inputs_on_host, mlp_tiles=plan.mlp_tiles
    )


def _counts(recipe: Recipe) -> ParamCounts:
    try:
        return count_parameters(recipe.model)
    except (OSError, ValueError, KeyError) as error:
        raise RecipeError(
            Problem(
                f"cannot build the model from the recipe: {error}", key="model", hint="check model.preset or model.path"
            )
        ) from None


def _plan(
    name: str,
    recipe: Recipe,
    *,
    counts: ParamCounts,
    cal: Calibration,
    micro_batch: int,
    exact_pinned: bool,
    densest_row_samples: int | None,
) -> Plan:
    """The whole plan: the model states placed, the step's phases priced, reserved memory from the allocator's
    slack, the host and NVMe bytes."""
    hw, stage = recipe.hardware, recipe.zero_stage
    compute_bytes = DTYPE_BYTES[recipe.precision.compute]
    states = _placed_states(recipe, counts)
    # compiled layers as the run would build them on a CUDA GPU (train.compile auto resolved for the plan's card)
    compiled = resolve_compile(recipe, cuda=True)
    shape = preference_shape(recipe)  # a preference objective's micro-batch of pairs is twice as many rows
    attention_bytes, packed_sequences = _attention_backward(
        recipe, micro_batch * shape.rows_per_sample, shape.rows_per_sample, densest_row_samples
    )
    acts, head, logits = _forward_terms(
        recipe, counts, micro_batch, shape.rows_per_sample, compiled=compiled, attention_backward_bytes=attention_bytes
    )
    buffers = _buffers(recipe, counts, stage, cal)
    model_states = states.gpu_params + states.gpu_gradients + states.gpu_optimizer_states
    saved = acts.saved_bytes + head
    phases = {
        "init": _init_bytes(stage, counts, states, cal, compute_bytes),
        "forward_end": model_states + buffers.resident_bytes + saved + logits.forward_bytes,
        "backward_start": model_states
        + buffers.resident_bytes
        + saved
        + _backward_extra_bytes(recipe, counts, acts, logits, compute_bytes),
        "optimizer_step": model_states + _step_transient_bytes(recipe, counts, buffers, compute_bytes),
    }
    if shape.no_grad_rows_per_sample:  # the reference's forward without gradient, before the policy's
        ref_rows = micro_batch * shape.no_grad_rows_per_sample
        phases["reference_forward"] = (
            model_states + buffers.resident_bytes + _no_grad_forward_bytes(recipe, counts, ref_rows)
        )
    pattern, expandable = allocation_pattern(recipe, stage), hw.expandable_segments
    init_slack = cal.init_slack(expandable)
    side = _side_streams(recipe, buffers, logits, cal)
    reserved = _reserved(
        phases, init_slack, cal.slack_ratio(pattern, expandable), side, cal.expandable_side_stream_slack_ratio
    )
    peak_phase = max(phases, key=lambda name: reserved[name])
    peak_allocated, peak_reserved = phases[peak_phase], reserved[peak_phase]
    peak_reserved_high = max(
        _reserved(
            phases,
            init_slack,
            cal.slack_ratio_high(pattern, expandable),
            side,
            cal.expandable_side_stream_slack_ratio_high,
        ).values()
    )
    reduce_stream = buffers.large_gradient_bytes if side.peak_bytes else 0
    terms = {
        "params": states.gpu_params,
        "gradients": states.gpu_gradients,
        "optimizer_states": states.gpu_optimizer_states,
        "activations": saved + acts.backward_extra_bytes,
        "logits_loss": logits.peak_bytes,
        "deepspeed_buffers": buffers.resident_bytes,
        # reserved, never counted as allocated at a phase: the reduce stream's copies of the largest gradient
        "reduce_stream": reduce_stream,
        "cuda_context": cal.cuda_context_bytes,
        "allocator_slack": peak_reserved - peak_allocated - reduce_stream,
    }
    # compiled layers keep a graph for training and, where a reference runs without gradient, one for it
    compiled_graphs = (1 + (shape.no_grad_rows_per_sample > 0)) if compiled else 0
    host_breakdown = _host_breakdown(recipe, counts, cal, states, acts, micro_batch, exact_pinned, compiled_graphs)
    save_bytes = checkpoint_save_bytes(recipe, counts, states)  # what a checkpoint save adds on the host
    host_phases = _host_phases(host_breakdown, save_bytes)
    nvme_breakdown = {"params": states.nvme_params, "optimizer_states": states.nvme_optimizer_states}
    return Plan(
        recipe_name=name,
        gpu_name=cal.name,
        gpus=hw.gpus,
        nodes=hw.nodes,
        zero_stage=stage,
        micro_batch=micro_batch,
        seq_len=recipe.data.seq_len,
        params_total=counts.total,
        params_trainable=counts.trainable,
        terms=terms,
        phases=phases,
        peak_phase=peak_phase,
        peak_allocated_bytes=peak_allocated,
        peak_reserved_bytes=peak_reserved,
        gpu_capacity_bytes=cal.capacity_bytes,
        host_bytes=max(host_phases.values()),
        host_breakdown=host_breakdown,
        host_phases=host_phases,
        host_kinds=host_kinds(recipe, host_breakdown, save_bytes, checkpoint_file_bytes(recipe, counts, states)),
        host_capacity_bytes=recipe.hardware.host_memory,
        nvme_bytes=sum(nvme_breakdown.values()),
        nvme_breakdown=nvme_breakdown,
        saved_for_backward={"layers": acts.saved_bytes, "head": head, "loss": logits.saved_bytes},
        pinned_exact=exact_pinned,
        peak_reserved_high_bytes=peak_reserved_high,
        checkpointing=describe_checkpointing(recipe.checkpointing),
        recomputed_layers=recomputed_layers(recipe.checkpointing, counts.num_layers),
        inputs_on_host=recipe.checkpointing.offload_inputs,
        mlp_tiles=recipe.checkpointing.mlp_tiles,
        compiled_layers=compiled,
        preference=describe(shape, recipe.train.objective),
        packed_sequences=packed_sequences,
        packed_sequences_counted=densest_row_samples is not None,
    )


def _placed_states(recipe: Recipe, counts: ParamCounts) -> StateBytes:
    """Parameters, gradients and optimizer states on each tier (quantised weights at their own size)."""
    p, o, hw = recipe.precision, recipe.offload, recipe.hardware
    # ZeRO partitions over every rank of every node; host and NVMe hold this node's `hw.gpus` ranks
    states = place_model_states(
        counts,
        stage=recipe.zero_stage,
        gpus=hw.world_size,
        compute=p.storage,
        master=p.master,
        optimizer_tier=o.optimizer,
        params_tier=o.params,
        ratio=o.ratio,
        buffer_count=o.buffer_count,
        eight_bit=recipe.optimizer.eight_bit,
        local_ranks=hw.gpus,
        in_backward=recipe.optimizer.step_in_backward,
        paged=recipe.optimizer.paged,
    )
    return with_quantized_params(states, counts, DTYPE_BYTES[p.storage])


def _forward_terms(
    recipe: Recipe,
    counts: ParamCounts,
    micro_batch: int,
    rows_per_sample: int,
    *,
    compiled: bool,
    attention_backward_bytes: int,
):
    """What the forward leaves for backward: the decoder layers' activations, the head's input (and a packed
    attention mask), and the logits and loss. With model.kernels resolved to liger the trace is edited by what
    Liger's RMSNorm and SwiGLU keep (activations.py). rows_per_sample: a preference objective's micro-batch of
    pairs is twice as many rows (plan/preference.py)."""
    p, seq_len = recipe.precision, recipe.data.seq_len
    rows = micro_batch * rows_per_sample
    acts = estimate_activations(
        recipe.model,
        recipe.checkpointing,
        p.compute,
        rows,
        seq_len,
        counts.num_layers,
        counts.layers_name,
        compiled=compiled,
        attention_backward_bytes=attention_backward_bytes,
    )
    head = _head_bytes(counts, DTYPE_BYTES[p.compute], rows * seq_len) + packed_attention_mask_bytes(
        recipe, micro_batch
    )
    # Liger's fused linear cross-entropy (model.kernels resolved to liger); a preference loss is always chunked
    if uses_fused_loss(recipe.model, p, recipe.zero_stage) and recipe.train.objective == "sft":
        logits = estimate_fused_logits(
            counts.hidden_size,
            counts.vocab_size,
            p.compute,
            micro_batch,
            seq_len,
            head_trainable=recipe.model.lora is None,
        )
    else:
        logits = _chunked_logits(recipe, counts, rows)
    return acts, head, logits


def _init_bytes(stage: int, counts: ParamCounts, states: StateBytes, cal: Calibration, compute_bytes: int) -> int:
    """Allocated at the end of deepspeed.initialize."""
    module_bytes = counts.weight_bytes(compute_bytes)
    if stage in (1, 2):
        return module_bytes + int(cal.zero_init_flat_copies * counts.trainable * compute_bytes)
    if stage == 3:  # built under zero.Init: each tensor is partitioned (or offloaded) as it is created
        return states.gpu_params + counts.largest_tensor * compute_bytes
    return module_bytes


def _backward_extra_bytes(recipe: Recipe, counts: ParamCounts, acts, logits, compute_bytes: int) -> int:
    """What backward adds on top of the saved activations at its start.

    Backward frees the loss's logits gradients before it reaches the last decoder layer, so the layer's
    recompute and gradient transients come after them, not on top."""
    stage = recipe.zero_stage
    if stage == 3 and recipe.hardware.expandable_segments:
        # ZeRO-3, per stream (gathered parameters and the reduce stream are priced as side streams): the compute
        # stream peaks either in the loss's backward, beside the head's gradient and its partitioned copy, or
        # in a recomputed layer's backward, beside that layer's gradients. What was live at the training peak
        # (benchmarks/segments/peaks-*.json, 1.1B at micro-batch 2 and 4): the saved layer inputs, the head's
        # gradient twice (DeepSpeed's linear backward and partition_grads) and the reduce stream's copies.
        return max(
            logits.backward_bytes + 2 * counts.largest_tensor * compute_bytes,
            acts.backward_extra_bytes + counts.largest_layer * compute_bytes,
        )
    if stage == 3:
        # caching allocator: the measured peaks match the sum (the max would be 4-7 % under on the H200);
        # parameters gathered for the first layers of backward are alive during the loss's backward there
        return acts.backward_extra_bytes + logits.backward_bytes
    return max(acts.backward_extra_bytes, logits.backward_bytes)


def _step_transient_bytes(recipe: Recipe, counts: ParamCounts, buffers, compute_bytes: int) -> int:
    """What the optimizer step allocates beside the model states."""
    p, stage, world_size = recipe.precision, recipe.zero_stage, recipe.hardware.world_size
    if recipe.optimizer.step_in_backward:  # each parameter updated during backward: no step afterwards
        return 0
    if recipe.offload.optimizer == "none":
        # fp32 gradients for the step; ZeRO-1/2 builds them from a flat compute-dtype copy of the
        # gradient partition that is alive at the same time (stage_1_and_2.py: flatten, then .to(fp32))
        per_param = 0 if p.compute == "fp32" else 4 + (compute_bytes if stage in (1, 2) else 0)
        return counts.trainable * per_param // (world_size if stage >= 1 else 1)
    return buffers.resident_bytes


def _side_streams(recipe: Recipe, buffers, logits, cal: Calibration) -> SideStreams:
    """With expandable segments, memory freed on one CUDA stream is not reused by another: each stream's
    segments keep that stream's own high-water mark. ZeRO-3 gathers parameters and reduces large
    gradients on side streams, so its reserved memory is the compute stream's peak plus theirs, not the
    peak of the sum (benchmarks/segments/*.json: the sum of the streams' segments, in every run).
    The compute stream's own slack is at least about one loss-sized tensor: the loss allocates and frees
    tokens x vocabulary fp32 tensors between the layers' blocks."""
    if recipe.zero_stage != 3 or not recipe.hardware.expandable_segments or whole_on_one_gpu(recipe):
        return SideStreams()
    min_slack = int(cal.expandable_zero3_min_slack_loss_tensors * logits.loss_tensor_bytes)
    return SideStreams(buffers.gathered_bytes, buffers.side_stream_bytes, min_slack)


# Host memory of compiled decoder layers, per compiled graph: inductor's generated kernels and the graphs it keeps.
# Measured as process RSS on the GPU machine (benchmarks/vs_hf.csv): eager LoRA runs 2.2 GiB (the baseline),
# compiled LoRA runs 2.3-2.6, compiled LoRA DPO 2.7, whose reference forward without gradient is a second graph.
COMPILED_GRAPH_HOST_BYTES = int(0.25 * GiB)


def _host_breakdown(
    recipe: Recipe,
    counts: ParamCounts,
    cal: Calibration,
    states: StateBytes,
    acts,
    micro_batch: int,
    exact_pinned: bool,
    compiled_graphs: int,
) -> dict[str, int]:
    """Host bytes of this machine by what holds them. compiled_graphs: the compiled layers' graphs (0 eager)."""
    p, o, hw = recipe.precision, recipe.offload, recipe.hardware
    accumulates = grad_accum_steps(recipe.batch.global_batch, micro_batch, hw.world_size) > 1
    breakdown = {
        "baseline": cal.host_baseline_bytes * hw.gpus,
        "compiled_layers": compiled_graphs * COMPILED_GRAPH_HOST_BYTES * hw.gpus,
        **offload_host_bytes(
            counts,
            stage=recipe.zero_stage,
            gpus=hw.gpus,
            storage=p.storage,
            master=p.master,
            optimizer_tier=o.optimizer,
            params_tier=o.params,
            pin_memory=o.pin_memory,
            exact_pinned=exact_pinned,
            accumulates=accumulates,
            world_size=hw.world_size,
            ratio=o.ratio,
        ),
        "swap_buffers": states.host_swap_buffers,
        # bitsandbytes' paged states (CUDA unified memory): priced where they go when the card is full
        "paged_optimizer_states": states.host_optimizer_states if o.optimizer == "none" else 0,
        "offloaded_activations": acts.host_bytes * hw.gpus,
        # checkpointing.offload_inputs: one pinned tensor per recomputed layer (save_on_cpu pins through PyTorch's
        # host allocator, whose cache keeps the blocks from step to step)
        "offloaded_layer_inputs": acts.host_inputs * pinned_bytes(acts.host_input_bytes, exact_pinned) * hw.gpus,
        # A local model's weights pass through host memory once while loading.
        "model_copy_at_load": counts.weight_bytes(DTYPE_BYTES[p.compute]) if recipe.model.path else 0,
    }
    # the pages' bookkeeping, machine-wide
    breakdown[PINNED_OVERHEAD] = int(cal.host_pinned_overhead_ratio * pinned_term_bytes(recipe, breakdown))
    return breakdown


def _host_phases(breakdown: dict[str, int], save_bytes: int) -> dict[str, int]:
    """Host bytes of this machine at its two peaks: training (the breakdown, with the model's copy while a local
    model.path loads) and a checkpoint save (every save_every steps and at the end: the breakdown without the load
    copy, which is gone by then, plus `save_bytes`, what DeepSpeed's save copies to the CPU; plan/host_save.py)."""
    training = sum(breakdown.values())
    saving = training - breakdown["model_copy_at_load"] + save_bytes
    return {"training": training, "checkpoint_save": saving}


def _chunked_logits(recipe: Recipe, counts: ParamCounts, rows: int):
    p = recipe.precision
    return estimate_logits(
        counts.hidden_size,
        counts.vocab_size,
        p.compute,
        rows,
        recipe.data.seq_len,
        p.chunked_loss,
        p.loss_chunk_tokens,
        p.fp32_loss,
        softcap=model_architecture(recipe.model).logit_softcap is not None,
    )


def _no_grad_forward_bytes(recipe: Recipe, counts: ParamCounts, rows: int) -> int:
    """A forward of `rows` without gradient (the preference reference's): nothing is kept for backward, so it holds
    one decoder layer's working set, the final norm's output and the loss forward's logits (a chunk when chunked)."""
    seq_len, compute = recipe.data.seq_len, recipe.precision.compute
    layer = trace_layer(recipe.model, compute, rows, seq_len).full_bytes
    head = _head_bytes(counts, DTYPE_BYTES[compute], rows * seq_len)
    return layer + head + _chunked_logits(recipe, counts, rows).forward_bytes


def recomputed_layers(checkpointing: Checkpointing, num_layers: int) -> int:
    """How many whole decoder layers a (resolved) strategy recomputes; 0 for block-level strategies."""
    if checkpointing.strategy == "every_layer":
        return num_layers
    if checkpointing.strategy == "every_n_layers":
        return -(-num_layers // checkpointing.every_n_layers)
    if checkpointing.strategy == "first_n_layers":
        return min(checkpointing.first_n_layers, num_layers)
    return 0


def describe_checkpointing(checkpointing: Checkpointing) -> str:
    """The strategy with its number, as plans and benchmark tables print it (first_n_layers=24; '+ inputs on host'
    with checkpointing.offload_inputs, '+ MLP in auto tiles' with checkpointing.mlp_tiles)."""
    on_host = " + inputs on host" if checkpointing.offload_inputs else ""
    on_host += f" + MLP in {checkpointing.mlp_tiles} tiles" if checkpointing.mlp_tiles != 0 else ""
    if checkpointing.strategy == "every_n_layers":
        return f"every_n_layers={checkpointing.every_n_layers}{on_host}"
    if checkpointing.strategy == "first_n_layers":
        return f"first_n_layers={checkpointing.first_n_layers}{on_host}"
    if checkpointing.strategy == "memory_budget":
        return f"memory_budget={checkpointing.memory_budget:g}"
    return checkpointing.strategy + on_host


@dataclass(frozen=True)
class SideStreams:
    """ZeRO-3's bytes on CUDA streams beside the compute stream (with expandable segments)."""

    resident_bytes: int = 0  # what every training phase's allocated bytes hold there (gathered parameters)
    peak_bytes: int = 0  # their segments' high-water mark (gathered parameters + the large gradient's copies)
    min_compute_slack_bytes: int = 0  # the compute stream's unused reserved bytes beside them, at least


def _reserved(
    phases: dict[str, int], init_ratio: float, ratio: float, side: SideStreams = SideStreams(), side_ratio: float = 0.0
) -> dict[str, int]:
    """Reserved bytes of each phase: the compute stream's allocated bytes plus the allocator's slack at that
    phase (a share of them, at least side.min_compute_slack_bytes), plus the side streams' high-water mark
    with its own, smaller slack."""

    def compute_stream(allocated: int) -> int:
        compute = allocated - side.resident_bytes
        return compute + max(int(compute * ratio), side.min_compute_slack_bytes)

    return {
        name: int(allocated * (1 + init_ratio))
        if name == "init"
        else compute_stream(allocated) + int(side.peak_bytes * (1 + side_ratio))
        for name, allocated in phases.items()
    }


def allocation_pattern(recipe: Recipe, stage: int) -> str:
    """What churns through the caching allocator during a step, which sets how much reserved memory
    sits unused at the peak (calibration.slack_ratio): ZeRO-3 gathers and frees every layer's
    parameters; a full fine-tune allocates and frees a gradient per weight; quantised weights are
    dequantised per matmul; LoRA on a plain frozen base churns only activations, and so does a full fine-tune
    stepping in backward (one weight's gradient at a time, freed at once)."""
    if stage == 3:
        return "zero3"
    if recipe.model.quant_type:
        return "quantized"
    if recipe.model.lora is not None or recipe.optimizer.step_in_backward:
        return "frozen"
    return "full"


def micro_batch_candidates(recipe: Recipe) -> list[int]:
    """Micro-batches that divide the per-GPU share of the global batch, smallest first."""
    b = recipe.batch
    per_gpu = b.global_batch // recipe.hardware.world_size
    return [m for m in range(1, per_gpu + 1) if per_gpu % m == 0]


def resolve_micro_batch(
    recipe: Recipe, gpu: str | None = None, exact_pinned: bool = True, densest_row_samples: int | None = None
) -> int:
    """The largest micro-batch dividing global_batch // world_size that fits the card (1 when none does),
    at the largest allocator slack measured for such runs (a tight fit is not taken).

    Memory grows with the micro-batch, so the search stops at the first size that misses.
    """
    if recipe.optimizer.step_in_backward:  # every micro-batch is an optimizer step: the whole batch, the only size
        return recipe.batch.global_batch // recipe.hardware.world_size
    best = 1
    for candidate in micro_batch_candidates(recipe):
        plan = plan_recipe(
            recipe, gpu, micro_batch=candidate, exact_pinned=exact_pinned, densest_row_samples=densest_row_samples
        )
        if not plan.fits or plan.tight:
            break
        best = candidate
    return best
