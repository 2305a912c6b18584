"""`train.compile`: torch.compile each decoder layer of the model ("regional" compilation), and when `auto` does.

The matmuls already run in cuBLAS; what compiling a layer buys is the element-wise work between them —
RMSNorm's fp32 upcast, the rotary embedding, SwiGLU's SiLU and product, LoRA's dropout, scaling and
addition — fused into a few kernels, in forward, in backward and in checkpointed recomputation alike.
All decoder layers share one code object, so one compilation serves them all (two under LoRA: the first layer's input,
from the frozen embeddings, needs no gradient).

Activation checkpointing stays outside the compiled region: each layer's own `forward` is compiled first, and
memtrain.model.recompute then wraps the compiled forward in its checkpoint, whatever transformers release is
installed. Compiled the other way round, dynamo traces the checkpoint as a higher-order op, whose region must have
no side effects; transformers' output recording writes a context variable inside every layer, so with transformers
5.25 (whose checkpoint sits in the layer's `forward`) dynamo broke the graph at each layer's checkpoint and compiled
only the frame inside it. That frame ran as fast (docs/BENCHMARKS.md, "Compiled layers"), but what was compiled
depended on where a transformers release put its checkpoint.

`auto` compiles where it was measured to win (docs/BENCHMARKS.md, "7B LoRA": the 7B LoRA recipe 11,583
tokens/s compiled against 7,701 for HF eager and 8,268 for HF + Liger in one invocation; Mistral-7B and
Qwen2.5-7B LoRA 1.17x and 1.21x their eager runs): LoRA on an unquantised base of a measured family, on a
CUDA GPU. A quantised base cannot be compiled (memtrain.recipe.rules.compile_unsupported). Compiled
layers are built without Liger's layer kernels (the same run with them: 8,021 tokens/s — dynamo cannot
trace their Triton launches and splits the layer around them), so `model.kernels: auto` then keeps only
Liger's fused loss (memtrain.model.kernels.resolve_kernels).

`train.cuda_graphs` replays each compiled layer as a CUDA graph (PyTorch's CUDA graph trees, torch.compile's
reduce-overhead mode). A compiled Llama-2-7B LoRA layer still launches some dozens of kernels and matmuls from Python;
at one 1,024-token row a micro-batch and nothing recomputed, that launch work outran the GPU (docs/BENCHMARKS.md,
"7B LoRA"). A replay is one launch. Graphs replay fixed shapes at fixed addresses, so they serve only micro-batches of
one width with nothing recomputed (memtrain.recipe.rules.cuda_graphs_unsupported), and the step keeps two promises to
the graph trees before each micro-batch (`ready_for_replay`): every trainable parameter already has its gradient
buffer, so backward adds the graph's gradient into it rather than keeping the graph's own output (which the next
replay overwrites), and a new micro-batch is announced, so the last one's outputs may be reused.

`checkpointing.strategy: memory_budget` hands the recompute to the compiler (PyTorch's activation memory budget, read
by its partitioner when each layer compiles): rather than a checkpoint rerunning the whole layer, backward recomputes
the operations that free the most memory for the least work, the element-wise ones first. The 7B LoRA recipe at
4 x 1024 with a budget of 0.3 stepped at 13,412 tokens/s against 11,606 with 0.2 in one invocation on an H100, and 0.2
at about 12,230 against 9,865 with every layer recomputed whole on one start (docs/BENCHMARKS.md, "7B LoRA"). Its
layers are not replayed as graphs: that ran out of memory.
"""

from __future__ import annotations

import torch
from torch import nn

from memtrain.model.config import model_architecture
from memtrain.model.layers import decoder_layer_names, hf_model
from memtrain.recipe.rules import compile_unsupported, cuda_graphs_unsupported
from memtrain.recipe.schema import Recipe

# model_type of the families whose compiled layers were measured on the GPU (benchmarks/vs_hf.csv)
MEASURED_FAMILIES = ("llama", "mistral", "qwen2")


def resolve_compile(recipe: Recipe, cuda: bool) -> bool:
    """`train.compile` made concrete for this machine. `true` / `false` stand (the recipe checks refused a
    `true` that cannot work); `auto` compiles LoRA of a measured family on CUDA, where nothing rules
    compilation out (ZeRO-3, activation offload, a quantised base) and lean LoRA dropout is off (its
    autograd function is not fused: measured slower compiled, docs/BENCHMARKS.md). Under checkpointing.strategy
    memory_budget it compiles wherever it can, the CPU included: only the compiler keeps that budget."""
    if recipe.train.compile != "auto":
        return recipe.train.compile
    if recipe.checkpointing.strategy == "memory_budget":  # the compiler carries that strategy out, on any device
        return compile_unsupported(recipe) is None
    lora = recipe.model.lora
    return (
        cuda
        and lora is not None
        and not lora.lean_dropout
        and model_architecture(recipe.model).model_type in MEASURED_FAMILIES
        and compile_unsupported(recipe) is None
    )


def resolve_cuda_graphs(recipe: Recipe, cuda: bool) -> bool:
    """`train.cuda_graphs` made concrete for a recipe whose train.compile and checkpointing are resolved. `false`
    stands; `true` and `auto` replay graphs on a CUDA GPU with compiled layers where nothing rules them out (`true`
    where something does was refused by the recipe checks)."""
    if recipe.train.cuda_graphs is False or not cuda or recipe.train.compile is not True:
        return False
    return cuda_graphs_unsupported(recipe) is None


# Graphs for fixed shapes only: a layer that meets a new shape (generation's growing cache, an evaluation's last
# short batch) recompiles with dynamic shapes, and that graph runs without replay instead of recording one per length.
CUDA_GRAPH_OPTIONS = {"triton.cudagraphs": True, "triton.cudagraph_skip_dynamic_graphs": True}


def ready_for_replay(trainable: list[nn.Parameter]) -> None:
    """Before a micro-batch's forward when the layers replay CUDA graphs: a zero gradient buffer for every trainable
    parameter without one (after the optimizer step cleared them), and the graph trees told that a new micro-batch
    starts, so they may overwrite the last one's outputs."""
    for parameter in trainable:
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
    torch.compiler.cudagraph_mark_step_begin()


def compile_layers(model: nn.Module, cuda_graphs: bool = False, memory_budget: float = 1.0) -> int:
    """Compile every decoder layer's forward in place; returns how many were compiled. Call before
    memtrain.model.recompute.apply_checkpointing, so that the checkpoint wraps the compiled forward.

    A layer the compiler fails on runs eager, with PyTorch's warning saying why (dynamo's suppress_errors, set for
    the process: compilation is the default now, and a model, PyTorch or driver it was not measured on should cost
    speed, not the run). The QLoRA failure measured on the GPU is refused before anything is built instead.
    cuda_graphs: replay each layer as a CUDA graph (train.cuda_graphs resolved). memory_budget: the share of each
    layer's activations beyond its inputs that backward may keep (checkpointing.strategy memory_budget; 1, PyTorch's
    default, keeps what its partitioner chooses for speed). It is set for the process, like suppress_errors, and read
    when a layer compiles, at its first call."""
    import torch._dynamo  # noqa: PLC0415 — heavy; only runs that compile their layers need it
    import torch._functorch.config  # noqa: PLC0415

    torch._dynamo.config.suppress_errors = True
    torch._functorch.config.activation_memory_budget = memory_budget
    options = CUDA_GRAPH_OPTIONS if cuda_graphs else None
    modules = dict(hf_model(model).named_modules())
    names = decoder_layer_names(model)
    for name in names:
        layer = modules[name]
        if hasattr(layer.forward, "checkpoint_action"):
            raise ValueError(f"{name} is already wrapped for checkpointing: compile the layers before that")
        layer.forward = torch.compile(layer.forward, options=options)
    return len(names)
