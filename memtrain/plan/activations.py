"""Activation bytes measured from the real Hugging Face modules, not a textbook formula.

One decoder layer of the recipe's model (the real module class, built on the meta device) is run
under FakeTensorMode on a fake CPU device — shapes and dtypes are real, no memory is used and the
attention kernel is the one SDPA picks (flash-style: saves q, k, v, out and a logsumexp, no
seq_len² term). `torch.autograd.graph.saved_tensors_hooks` records every tensor autograd keeps for
backward, deduplicated by storage, with the module that saved it, so any checkpoint strategy is
priced by leaving out what a checkpointed block would recompute and keeping its input instead.
"""

from __future__ import annotations

import fnmatch
import math
import weakref
from dataclasses import dataclass, field, replace
from functools import lru_cache

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memtrain.dtypes import DTYPES
from memtrain.model.build import add_lora
from memtrain.model.config import model_config
from memtrain.model.kernels import patches_layers
from memtrain.model.layers import decoder_layers, hf_model
from memtrain.model.tiled_mlp import MLP_NAME, tile_count
from memtrain.model.varlen import ATTN_NAME as VARLEN
from memtrain.recipe.schema import Checkpointing, Model


@dataclass(frozen=True)
class SavedTensor:
    storage_id: int
    nbytes: int
    module: str  # innermost submodule (dotted, relative to the layer) that saved it; "" for the layer itself


@dataclass(frozen=True)
class LayerTrace:
    """What one decoder layer keeps for backward at a given micro-batch and sequence length."""

    saved: tuple[SavedTensor, ...]
    inputs: dict[str, tuple[int, int]] = field(default_factory=dict)  # submodule -> (storage_id, nbytes) of its input
    layer_input_bytes: int = 0
    shared_bytes: int = 0  # rotary cos/sin: computed once per model and shared by every layer

    def saved_bytes(self, recompute: tuple[str, ...] = (), offload: tuple[str, ...] = ()) -> tuple[int, int]:
        """(GPU bytes, host bytes) this layer keeps when the given submodules are recomputed / offloaded.

        A recomputed or offloaded block keeps only its input (on the GPU, or on the host when offloaded).
        """

        def inside(module: str, blocks: tuple[str, ...]) -> bool:
            return any(module == b or module.startswith(b + ".") for b in blocks)

        gpu: dict[int, int] = {}
        for tensor in self.saved:
            if not inside(tensor.module, recompute + offload):
                gpu[tensor.storage_id] = tensor.nbytes
        for block in recompute:
            storage_id, nbytes = self.inputs[block]
            gpu[storage_id] = nbytes
        host: dict[int, int] = {}
        for block in offload:
            storage_id, nbytes = self.inputs[block]
            if storage_id not in gpu:
                host[storage_id] = nbytes
        return sum(gpu.values()), sum(host.values())

    @property
    def full_bytes(self) -> int:
        return self.saved_bytes()[0]

    @property
    def largest_saved_bytes(self) -> int:
        return max((t.nbytes for t in self.saved), default=0)

    def block_bytes(self, block: str) -> int:
        """Bytes saved inside one submodule (what recomputing it brings back during backward)."""
        unique = {t.storage_id: t.nbytes for t in self.saved if t.module == block or t.module.startswith(block + ".")}
        return sum(unique.values())


def _layer_and_rotary(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The first decoder layer and the model's rotary embedding module (None without one)."""
    name, layers = decoder_layers(model)  # named within the model under a PEFT wrapper
    model = hf_model(model)
    base = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    return layers[0], getattr(base, "rotary_emb", None)


def trace_layer(model: Model, compute: str, micro_batch: int, seq_len: int) -> LayerTrace:
    """Trace one decoder layer of the recipe's model at (micro_batch, seq_len) in the compute dtype."""
    return _trace_layer(model.model_dump_json(), compute, micro_batch, seq_len)


def one_layer_model(model: Model, dtype: torch.dtype) -> torch.nn.Module:
    """The recipe's model class with a single decoder layer, on the meta device.

    FlashAttention-2 is traced as sdpa, whose flash-style kernel keeps what flash-attn keeps for backward (q, k,
    v, out, a logsumexp): the trace runs on the CPU, where flash-attn cannot, and need not be installed. PyTorch's
    varlen kernel is the same FlashAttention-2 and keeps the same tensors (q, k, v, out, a (heads, tokens) fp32
    logsumexp), so it is traced as sdpa too: one row with no restart, as the layer sees a packed row's tokens."""
    from transformers import AutoModelForCausalLM

    config = model_config(model)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1]
    kernel = "sdpa" if config._attn_implementation in ("flash_attention_2", VARLEN) else config._attn_implementation
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=kernel)


def _with_lora(module: torch.nn.Module, model: Model, dtype: torch.dtype) -> torch.nn.Module:
    """The one-layer model as it trains under LoRA: frozen base weights (autograd then keeps no input
    for their weight gradients) and PEFT's adapters, whose dropout and down-projection keep theirs
    (with lean dropout, the A matrices keep the shared input and no mask: memtrain.model.lora_dropout).
    PEFT creates adapters in fp32; DeepSpeed's engine casts them to the compute dtype, so does this.
    Quantised bases are traced as plain frozen weights."""
    if model.lora is None:
        return module

    return add_lora(module, model).to(dtype)


@lru_cache(maxsize=256)
def _trace_layer(model_json: str, compute: str, micro_batch: int, seq_len: int) -> LayerTrace:
    dtype = DTYPES[compute]
    recipe_model = Model.model_validate_json(model_json)
    model = _with_lora(one_layer_model(recipe_model, dtype), recipe_model, dtype)
    model.train()
    layer, rotary = _layer_and_rotary(model)
    hidden = model.config.hidden_size
    saved: list[tuple[SavedTensor, weakref.ref]] = []
    inputs: dict[str, tuple[int, int]] = {}
    outputs: dict[str, int] = {}  # submodule -> storage id of its output
    stack: list[str] = [""]
    names = {module: name for name, module in layer.named_modules()}
    modules = {name: module for module, name in names.items()}

    def pre_hook(module, args, kwargs):
        name = names[module]
        stack.append(name)
        first = args[0] if args else kwargs.get("hidden_states")
        if name and isinstance(first, torch.Tensor) and name not in inputs:
            storage = first.untyped_storage()
            inputs[name] = (storage._cdata, storage.nbytes())

    def post_hook(module, args, kwargs, output):
        stack.pop()
        if isinstance(output, torch.Tensor):
            outputs[names[module]] = output.untyped_storage()._cdata

    handles = []
    for module in names:
        handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
        handles.append(module.register_forward_hook(post_hook, with_kwargs=True))
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            layer.to_empty(device="cpu")
            x = torch.empty(micro_batch, seq_len, hidden, dtype=dtype, requires_grad=True)
            positions = torch.arange(seq_len).unsqueeze(0).expand(micro_batch, -1)
            shared: set[int] = set()
            position_embeddings = None
            if rotary is not None:
                rotary.to_empty(device="cpu")
                position_embeddings = tuple(t.to(dtype) for t in rotary(x, positions))
                shared = {t.untyped_storage()._cdata for t in position_embeddings}
            params = {p.untyped_storage()._cdata for p in layer.parameters()}

            def pack(tensor: torch.Tensor) -> torch.Tensor:
                storage = tensor.untyped_storage()
                if storage._cdata not in params and storage._cdata not in shared:
                    # CUDA's dropout keeps a bool mask; the CPU kernel traced here keeps it in the input dtype.
                    # (Lean LoRA dropout keeps no mask: it regenerates it from a seed, also under this fake mode.)
                    nbytes = (
                        tensor.numel() if isinstance(modules.get(stack[-1]), torch.nn.Dropout) else storage.nbytes()
                    )
                    saved.append((SavedTensor(storage._cdata, nbytes, stack[-1]), weakref.ref(tensor)))
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                output = layer(x, attention_mask=None, position_ids=positions, position_embeddings=position_embeddings)
            # Only what the layer output's graph still holds is kept for backward: a side graph that was
            # detached (DoRA's weight norm goes through lora_B(lora_A(eye))) is freed during forward, and the
            # address of a freed storage may be reused by a later one, which would merge two tensors into one.
            kept = tuple(tensor for tensor, alive in saved if alive() is not None)
            if patches_layers(recipe_model):
                kept = _as_liger_keeps(kept, modules, inputs, outputs, rows=micro_batch * seq_len)
            del output
            shared_bytes = sum(t.untyped_storage().nbytes() for t in position_embeddings or ())
    finally:
        for handle in handles:
            handle.remove()
    return LayerTrace(
        saved=kept,
        inputs=inputs,
        layer_input_bytes=micro_batch * seq_len * hidden * dtype.itemsize,
        shared_bytes=shared_bytes,
    )


def _as_liger_keeps(
    saved: tuple[SavedTensor, ...],
    modules: dict[str, torch.nn.Module],
    inputs: dict[str, tuple[int, int]],
    outputs: dict[str, int],
    rows: int,
) -> tuple[SavedTensor, ...]:
    """What a layer keeps for backward with Liger's modules (model.kernels: liger) instead of the eager ones traced.

    Liger's kernels cannot run under the fake CPU tensors of the trace, so the eager trace is edited by what their
    autograd functions save (liger_kernel/ops, 0.8.5): an RMSNorm keeps its input and one fp32 rstd per row, not
    the eager norm's fp32 copy of the input and its bf16 normalised copy; the fused SiLU/GELU-and-multiply keeps
    the gate and up projections, not the activation's output. (Measured on the GPU: a 7B layer kept ~90 KiB less
    per token than the eager trace, 182 KiB; these two account for 53.5 KiB of it.)"""
    norms = [name for name, module in modules.items() if name and type(module).__name__.endswith("RMSNorm")]
    activations = {
        outputs[name]
        for name, module in modules.items()
        if name in outputs and type(module).__module__.startswith("transformers.activations")
    }

    def inside_norm(module: str) -> bool:
        return any(module == n or module.startswith(n + ".") for n in norms)

    kept = [t for t in saved if not inside_norm(t.module) and t.storage_id not in activations]
    for norm in norms:
        if norm in inputs:
            storage_id, nbytes = inputs[norm]
            kept += [SavedTensor(storage_id, nbytes, norm), SavedTensor(-len(kept) - 1, rows * 4, norm)]  # rstd
    return tuple(kept)


def tiled_mlp_trace(trace: LayerTrace, tiles: int) -> tuple[LayerTrace, int]:
    """(what the layer keeps with its MLP tiled, the bytes one tile's backward holds) for checkpointing.mlp_tiles.

    The trace runs the MLP untiled (the tiled one is DeepSpeed's autograd function, whose backward the trace does not
    run), so the tiling is priced from it: forward keeps only the MLP's input (memtrain.model.tiled_mlp); backward
    recomputes one tile at a time, holding that tile's share of what the untiled MLP kept and the gradients of its
    two largest intermediates. Untiled (tiles 0) or without an `mlp` block: the trace as it is and 0."""
    if tiles == 0 or MLP_NAME not in trace.inputs:
        return trace, 0

    def inside(module: str) -> bool:
        return module == MLP_NAME or module.startswith(MLP_NAME + ".")

    block = trace.block_bytes(MLP_NAME)
    largest = max((t.nbytes for t in trace.saved if inside(t.module)), default=0)
    storage_id, nbytes = trace.inputs[MLP_NAME]
    kept = tuple(t for t in trace.saved if not inside(t.module)) + (SavedTensor(storage_id, nbytes, MLP_NAME),)
    return replace(trace, saved=kept), math.ceil(block / tiles) + 2 * math.ceil(largest / tiles)


@dataclass(frozen=True)
class ActivationEstimate:
    """Activation bytes of the whole decoder stack on one GPU."""

    saved_bytes: int  # kept from forward for backward at the end of forward
    backward_extra_bytes: int  # recomputed block + gradient transients at the start of backward
    host_bytes: int  # activations offloaded to host memory by checkpoint rules
    host_inputs: int = 0  # checkpointing.offload_inputs: recomputed layers whose input is on the host
    host_input_bytes: int = 0  # ... each one pinned tensor of this size (priced as the host allocator pins it)

    @property
    def peak_bytes(self) -> int:
        return self.saved_bytes + self.backward_extra_bytes


# Blocks the "selective" strategy recomputes (the article's default: attention and MLP, never a residual add).
SELECTIVE_BLOCKS = ("self_attn", "mlp")
ATTENTION_BLOCK = SELECTIVE_BLOCKS[0]


def _rule_blocks(
    rules: dict[str, str], layer_prefix: str, index: int, trace: LayerTrace
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(recompute, offload) submodules of layer `index` named by checkpoint rules (globs on full module names)."""
    recompute: list[str] = []
    offload: list[str] = []
    candidates = [""] + list(trace.inputs)
    for block in candidates:
        full = f"{layer_prefix}.{index}" + (f".{block}" if block else "")
        for pattern, action in rules.items():
            if fnmatch.fnmatchcase(full, pattern) and action != "save":
                (recompute if action == "recompute" else offload).append(block)
                break

    # An outer block that is recomputed covers its inner blocks.
    def outermost(blocks: list[str]) -> tuple[str, ...]:
        return tuple(b for b in blocks if not any(o != b and (o == "" or b.startswith(o + ".")) for o in blocks))

    return outermost(recompute), outermost(offload)


# Compiled layers (train.compile): the recomputed layer's backward holds this share of the layer's eager keeps on top of
# them (inductor's fused backward kernels write their intermediates at once). Fitted on the two compiled Llama-2-7B
# LoRA runs of benchmarks/vs_hf.csv (0.41 and 0.46 GiB over the eager pricing at 4,096 tokens: 0.45 and 0.50 of a
# layer's 0.91 GiB); the compiled Mistral-7B and Qwen2.5-7B runs were not used (0.51 and 0.61). Layers kept whole are
# priced as eager, an upper bound (measured: a compiled run with 3 of 32 layers kept peaked 0.8 GiB under the eager
# run).
COMPILED_RECOMPUTE_SHARE = 0.5
# checkpointing.strategy memory_budget: PyTorch measures the budget against what its default (min-cut) partition of the
# compiled layer keeps beyond the layer's inputs, which is less than the eager trace keeps (fused element-wise chains
# are recomputed in backward rather than kept). Priced as this share of the eager trace's keeps beyond the input,
# fitted on six Llama-2-7B LoRA runs at budgets 0.05 to 0.35 (benchmarks/vs_hf.csv, one H100 start): with the whole
# eager trace the plan was 3.9 to 9.3 % over them, with 0.85 between -0.5 and +3.1 %.
COMPILED_DEFAULT_KEEP_SHARE = 0.85


def estimate_activations(
    model: Model,
    checkpointing: Checkpointing,
    compute: str,
    micro_batch: int,
    seq_len: int,
    num_layers: int,
    layer_prefix: str = "model.layers",
    compiled: bool = False,
    attention_backward_bytes: int = 0,
) -> ActivationEstimate:
    """Activation bytes of `num_layers` decoder layers under a checkpoint strategy, from one traced layer.

    Full checkpointing keeps one input per checkpointed layer; during backward one layer is recomputed
    in full, beside the gradients of its largest intermediate (input and output gradient). `compiled`: the
    layers are compiled (COMPILED_RECOMPUTE_SHARE). attention_backward_bytes: what the attention kernel's backward
    allocates for one call (plan/attention_backward.py; 0 where the trace holds it all).
    """
    trace = trace_layer(model, compute, micro_batch, seq_len)
    tiles = tile_count(checkpointing.mlp_tiles, seq_len, model_config(model).hidden_size)
    trace, tile_bytes = tiled_mlp_trace(trace, tiles)
    full = trace.full_bytes
    # the gradients of the largest intermediates: two new ones with eager modules; Liger's fused SiLU/GELU-and-multiply
    # writes the gate's and up projection's gradients into their saved outputs in place, leaving one (its output's)
    gradient_transient = (1 if patches_layers(model) else 2) * max(trace.largest_saved_bytes, trace.layer_input_bytes)
    strategy = checkpointing.strategy
    host = 0
    if strategy == "none":
        saved, recomputed = num_layers * full, 0
    elif strategy in ("every_layer", "every_n_layers"):
        every = 1 if strategy == "every_layer" else checkpointing.every_n_layers
        checkpointed = math.ceil(num_layers / every)
        saved = checkpointed * trace.layer_input_bytes + (num_layers - checkpointed) * full
        recomputed = full
    elif strategy == "first_n_layers":
        checkpointed = min(checkpointing.first_n_layers, num_layers)
        saved = checkpointed * trace.layer_input_bytes + (num_layers - checkpointed) * full
        # Backward starts at the last layer: a layer is recomputed only after every later, fully saved
        # layer has been freed, so the recompute adds to the peak only when every layer is checkpointed.
        recomputed = full if checkpointed == num_layers else 0
    elif strategy == "memory_budget":
        # PyTorch's budget bounds what the compiled layer keeps beyond its inputs at memory_budget x what it keeps by
        # default (COMPILED_DEFAULT_KEEP_SHARE of the eager trace). In backward a layer brings back at most the rest.
        beyond_input = COMPILED_DEFAULT_KEEP_SHARE * max(0, full - trace.layer_input_bytes)
        kept = trace.layer_input_bytes + int(checkpointing.memory_budget * beyond_input)
        saved, recomputed = num_layers * kept, full - kept
    elif strategy == "selective":
        blocks = tuple(b for b in SELECTIVE_BLOCKS if b in trace.inputs)
        saved = num_layers * trace.saved_bytes(recompute=blocks)[0]
        recomputed = max((trace.block_bytes(block) for block in blocks), default=0)
    else:
        saved = recomputed = 0
        for index in range(num_layers):
            recompute, offload = _rule_blocks(checkpointing.rules, layer_prefix, index, trace)
            if "" in recompute or "" in offload:
                whole_layer_on_host = "" in offload
                gpu_bytes = 0 if whole_layer_on_host else trace.layer_input_bytes
                host_bytes = trace.layer_input_bytes if whole_layer_on_host else 0
                recomputed = max(recomputed, full)
            else:
                gpu_bytes, host_bytes = trace.saved_bytes(recompute=recompute, offload=offload)
                recomputed = max([recomputed] + [trace.block_bytes(b) for b in recompute + offload])
            saved += gpu_bytes
            host += host_bytes
    if compiled and strategy != "memory_budget":  # a checkpoint around a compiled layer (COMPILED_RECOMPUTE_SHARE)
        recomputed += int(COMPILED_RECOMPUTE_SHARE * recomputed)
    # what a recomputed layer's attention block brings back for its own backward (q, k, v, out, the projections' inputs)
    attention_saved = trace.block_bytes(ATTENTION_BLOCK) if recomputed else 0
    # a tiled MLP's backward (in every layer, recomputed or not) holds one tile's intermediates at a time
    recomputed += tile_bytes
    host_inputs, brought_back = 0, 0
    if checkpointing.offload_inputs and strategy in ("every_layer", "every_n_layers", "first_n_layers"):
        # the checkpointed layers' inputs leave the GPU for pinned host memory; in backward each comes back for its
        # layer's recompute (copied on the compute stream, unpacked just before use): one input more on the GPU
        host_inputs = checkpointed
        saved -= checkpointed * trace.layer_input_bytes
        brought_back = trace.layer_input_bytes if recomputed else 0
    # A layer's backward runs its MLP's first, then its attention's: the kernel's backward allocates for the whole
    # call (attention_backward_bytes) once the MLP's saved tensors and their gradients are freed. Whichever phase
    # holds more is the layer's peak.
    mlp_phase = recomputed + gradient_transient
    attention_phase = attention_saved + attention_backward_bytes
    return ActivationEstimate(
        saved_bytes=saved + trace.shared_bytes,
        backward_extra_bytes=brought_back + max(mlp_phase, attention_phase),
        host_bytes=host,
        host_inputs=host_inputs,
        host_input_bytes=trace.layer_input_bytes if host_inputs else 0,
    )
