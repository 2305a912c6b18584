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
"""

from __future__ import annotations

from torch import nn

from memtrain.model.config import model_architecture
from memtrain.model.layers import decoder_layer_names, hf_model
from memtrain.recipe.rules import compile_unsupported
from memtrain.recipe.schema import Recipe

# model_type of the families whose compiled layers were measured on the GPU (benchmarks/vs_hf.csv)
MEASURED_FAMILIES = ("llama", "mistral", "qwen2")


def resolve_compile(recipe: Recipe, cuda: bool) -> bool:
    """`train.compile` made concrete for this machine. `true` / `false` stand (the recipe checks refused a
    `true` that cannot work); `auto` compiles LoRA of a measured family on CUDA, where nothing rules
    compilation out (ZeRO-3, activation offload, a quantised base) and lean LoRA dropout is off (its
    autograd function is not fused: measured slower compiled, docs/BENCHMARKS.md)."""
    if recipe.train.compile != "auto":
        return recipe.train.compile
    lora = recipe.model.lora
    return (
        cuda
        and lora is not None
        and not lora.lean_dropout
        and model_architecture(recipe.model).model_type in MEASURED_FAMILIES
        and compile_unsupported(recipe) is None
    )


def compile_layers(model: nn.Module) -> int:
    """Compile every decoder layer's forward in place; returns how many were compiled. Call before
    memtrain.model.recompute.apply_checkpointing, so that the checkpoint wraps the compiled forward.

    A layer the compiler fails on runs eager, with PyTorch's warning saying why (dynamo's suppress_errors, set for
    the process: compilation is the default now, and a model, PyTorch or driver it was not measured on should cost
    speed, not the run). The QLoRA failure measured on the GPU is refused before anything is built instead."""
    import torch._dynamo  # noqa: PLC0415 — heavy; only runs that compile their layers need it

    torch._dynamo.config.suppress_errors = True
    modules = dict(hf_model(model).named_modules())
    names = decoder_layer_names(model)
    for name in names:
        layer = modules[name]
        if hasattr(layer.forward, "checkpoint_action"):
            raise ValueError(f"{name} is already wrapped for checkpointing: compile the layers before that")
        layer.forward = torch.compile(layer.forward)
    return len(names)
