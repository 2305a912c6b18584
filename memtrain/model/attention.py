"""`model.attn_implementation` made concrete for this machine and this data.

auto: instruction and chat rows, packed or not, and preference pairs (KTO's records aside), on a CUDA GPU that
runs PyTorch's variable-length flash kernel (memtrain.model.varlen: compute capability 8.0 or newer, a PyTorch that
has it) go through it, in fp16 or bf16; text windows and KTO records keep sdpa (a plain row needs no sample bounds,
and sdpa runs a flash kernel on it). Unpacked rows and pairs through it are laid out packed within each step
(`packs_steps`, data/rows/loader.py): one shape of micro-batch for the whole run instead of a width per micro-batch,
each new one a kernel plan and a recompile on the GPU, and no padding to the longest row. On the
CPU, and in fp32, the kernel cannot run, so packed rows keep sdpa's block-diagonal mask there. Models whose
attention sdpa cannot run (Gemma-2's soft-capped scores) keep eager either way (memtrain.model.architecture).
"""

from __future__ import annotations

from memtrain.dtypes import DTYPES
from memtrain.errors import Problem, UserError
from memtrain.model.varlen import HALF_DTYPES
from memtrain.recipe.schema import Recipe


def packs_samples(recipe: Recipe) -> bool:
    """Whether the rows hold several samples each (instruction and chat data with data.packing)."""
    return not recipe.data.is_text and recipe.data.packing


def holds_samples(recipe: Recipe) -> bool:
    """Whether the rows hold instruction or chat samples (one or several a row), not text windows or pairs."""
    return not recipe.data.is_text and not recipe.data.holds_pairs


def holds_packable_pairs(recipe: Recipe) -> bool:
    """Whether the rows are preference pairs whose sequences may share a row (data/rows/pairs.py): DPO's, IPO's,
    SimPO's and ORPO's; KTO's records and their KL rows run apart (two forwards, one without gradient)."""
    return recipe.data.holds_pairs and recipe.train.objective != "kto"


def packs_steps(recipe: Recipe) -> bool:
    """Whether unpacked sample rows, or preference pairs, are laid out packed within each step
    (data/rows/loader.py): where the resolved attention is varlen, which keeps the samples of a row apart without a
    mask. Several processes run as many micro-batches a step as each other (loader.packed_micro_batches' count)."""
    unpacked_samples = holds_samples(recipe) and not recipe.data.packing
    return recipe.model.attn_implementation == "varlen" and (unpacked_samples or holds_packable_pairs(recipe))


def resolve_attention(recipe: Recipe, varlen: bool) -> str:
    """The kernel the run builds its model with. `varlen`: this machine can run the variable-length kernel
    (memtrain.model.varlen.varlen_available; the planner passes True, pricing the recipe's CUDA card).

    Raises UserError (key model.attn_implementation) for varlen asked where it cannot run."""
    asked = recipe.model.attn_implementation
    half = DTYPES[recipe.precision.compute] in HALF_DTYPES
    if asked == "auto":
        return "varlen" if varlen and half and (holds_samples(recipe) or holds_packable_pairs(recipe)) else "sdpa"
    if asked == "varlen" and not half:
        raise UserError(
            Problem(
                f"varlen attention runs in fp16 or bf16, and precision.compute is {recipe.precision.compute}",
                key="model.attn_implementation",
                hint="set model.attn_implementation: auto (sdpa here), or precision.compute: bf16",
            )
        )
    return asked


def with_attention(recipe: Recipe, attn_implementation: str) -> Recipe:
    """The recipe with model.attn_implementation set (the same object when it already says so)."""
    if recipe.model.attn_implementation == attn_implementation:
        return recipe
    return recipe.model_copy(
        update={"model": recipe.model.model_copy(update={"attn_implementation": attn_implementation})}
    )
