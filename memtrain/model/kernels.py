"""Liger's Triton kernels (`model.kernels`): which runs use them, and patching them in before the model is built.

liger-kernel is optional (`pip install 'memtrain[liger]'`): the CPU has no Triton kernels, so CI and CPU
runs never import it. `auto` uses Liger where it is importable, CUDA is present and the model's family has
a patch; `liger` requires all three (UserError otherwise); `none` never uses it. A run resolves `auto` once
(memtrain.train.resolve), so the plan, the DeepSpeed engine and run.json all see `liger` or `none`.

What is patched: RMSNorm, the gated MLP (SwiGLU; GEGLU for Gemma-2) and the rotary embedding, as
transformers' module-level classes and functions, before the model is built (so ZeRO-3's zero.Init and
PEFT see the Liger modules). Liger's own causal-LM forward is not patched in: memtrain computes the loss
itself (memtrain.model.wrapper). Where `uses_fused_loss` says so, that loss is Liger's fused linear
cross-entropy instead of memtrain's chunked one (memtrain.model.loss.fused_causal_lm_loss).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

import torch

from memtrain.errors import Problem, UserError
from memtrain.model.config import model_architecture
from memtrain.model.recompute import name_matches
from memtrain.model.varlen import varlen_available
from memtrain.recipe.schema import Model, Precision

# model_type -> (Liger's apply function, its keyword for the gated MLP). Each of these families names its
# output head `lm_head`, which the fused loss reads.
LIGER_FAMILIES = {
    "llama": ("apply_liger_kernel_to_llama", "swiglu"),
    "mistral": ("apply_liger_kernel_to_mistral", "swiglu"),
    "qwen2": ("apply_liger_kernel_to_qwen2", "swiglu"),
    "qwen3": ("apply_liger_kernel_to_qwen3", "swiglu"),
    "gemma2": ("apply_liger_kernel_to_gemma2", "geglu"),
    "phi3": ("apply_liger_kernel_to_phi3", "swiglu"),
}
HEAD_NAME = "lm_head"


@dataclass(frozen=True)
class KernelSupport:
    """What this machine offers the kernels (handed in, so a test can ask "what if CUDA were here")."""

    liger: bool  # liger_kernel can be imported
    cuda: bool  # a CUDA device is present
    varlen: bool = False  # PyTorch's variable-length flash kernel runs here (memtrain.model.varlen)

    @classmethod
    def current(cls) -> "KernelSupport":
        return cls(
            liger=importlib.util.find_spec("liger_kernel") is not None,
            cuda=torch.cuda.is_available(),
            varlen=varlen_available(),
        )


def liger_family(model: Model) -> str | None:
    """The model's family when Liger has a patch for it, else None."""
    model_type = model_architecture(model).model_type
    return model_type if model_type in LIGER_FAMILIES else None


def resolve_kernels(model: Model, support: KernelSupport, compiled: bool = False) -> str:
    """`model.kernels` made concrete for this machine: 'liger', 'liger_loss' or 'none'. `compiled`: the run's
    decoder layers are compiled (train.compile resolved), so `auto` takes Liger's fused loss only
    (memtrain.model.compiled: torch.compile fuses the layers better than it runs Liger's kernels inside them).

    Raises UserError (key model.kernels) when the recipe asks for Liger and it cannot run here.
    """
    if model.kernels == "none":
        return "none"
    family = liger_family(model)
    if model.kernels == "auto":
        usable = support.liger and support.cuda and family is not None
        return ("liger_loss" if compiled else "liger") if usable else "none"
    problems = []
    if family is None:
        problems.append(
            Problem(
                f"Liger has no kernels for the model type '{model_architecture(model).model_type}'",
                key="model.kernels",
                hint=f"it patches {', '.join(LIGER_FAMILIES)}; set model.kernels: auto or none",
            )
        )
    if not support.liger:
        problems.append(
            Problem(
                f"{model.kernels} needs liger-kernel, which is not installed",
                key="model.kernels",
                hint="pip install 'memtrain[liger]', or set model.kernels: auto (uses it where installed)",
            )
        )
    if not support.cuda:
        problems.append(
            Problem(
                f"{model.kernels} needs a CUDA GPU (Liger's kernels are Triton kernels)",
                key="model.kernels",
                hint="set model.kernels: auto or none on this machine",
            )
        )
    if problems:
        raise UserError(problems)
    return model.kernels


def patches_layers(model: Model) -> bool:
    """Whether Liger's RMSNorm, gated MLP and RoPE replace transformers' (model.kernels resolved to liger)."""
    return model.kernels == "liger"


def uses_fused_loss(model: Model, precision: Precision, zero_stage: int) -> bool:
    """Whether the loss is Liger's fused linear cross-entropy instead of the chunked loss: one owner for the
    run (memtrain.train.setup) and the planner. Needs `model.kernels` resolved ('auto' counts as no; liger
    and liger_loss both use it).

    Not under ZeRO-3 (the fused loss reads the head's weight directly; ZeRO-3 gathers it only inside the
    head's own forward), not under precision.mode autocast or with fp32_modules naming the head (the head's
    weight and the hidden states must share the compute dtype), and not when LoRA trains a copy of a module
    (PEFT's modules_to_save wrapper stands where the head was).
    """
    if model.kernels not in ("liger", "liger_loss") or zero_stage == 3 or precision.mode != "cast":
        return False
    if any(name_matches(HEAD_NAME, glob) for glob in precision.fp32_modules):
        return False
    return model.lora is None or not model.lora.modules_to_save


def apply_liger_kernels(model: Model) -> None:
    """Patch transformers' classes of this model's family with Liger's RMSNorm, gated MLP and RoPE
    (process-wide, idempotent). Call only where `patches_layers`."""
    family = liger_family(model)
    if family is None:  # resolve_kernels refused it already; a guard for other callers
        raise UserError(Problem("Liger has no kernels for this model type", key="model.kernels"))
    function_name, mlp_keyword = LIGER_FAMILIES[family]
    patch = getattr(importlib.import_module("liger_kernel.transformers"), function_name)
    patch(rope=True, rms_norm=True, cross_entropy=False, fused_linear_cross_entropy=False, **{mlp_keyword: True})
