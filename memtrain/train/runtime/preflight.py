"""Before any GPU work: ask the planner whether the host can hold what the recipe puts there, and
whether this machine can compute in the recipe's dtype at all.

A host that cannot hold the offloaded states is OOM-killed minutes into a run (LLaMA-Factory users
at 160 GB); the planner knows the bytes in advance. The GPU side is only a warning: the batch
policy and OOM recovery handle it, and a plan above the card names the change that fits.
"""

from __future__ import annotations

import psutil
import torch

from memtrain.checks.environment import current_environment
from memtrain.checks.load import recipe_checks
from memtrain.errors import UserError
from memtrain.plan.advice import advise, with_overrides
from memtrain.plan.planner import plan_recipe
from memtrain.recipe.sources import LoadedRecipe
from memtrain.units import gib

# Optimizer states on NVMe as DeepSpeed takes them, whatever the recipe had: ZeRO-3 (below it they stay in host
# memory) and fp32 master weights (its swapper stops on bf16 ones; recipe/rules.py).
NVME_OPTIMIZER = ("offload.optimizer=nvme", "offload.zero_stage=3", "precision.master=fp32")


def host_capacity_bytes(loaded: LoadedRecipe) -> int:
    """hardware.host_memory when the recipe says, else what this machine has."""
    return loaded.recipe.hardware.host_memory or psutil.virtual_memory().total


def check_memory(loaded: LoadedRecipe, exact_pinned: bool, densest_row_samples: int | None = None) -> list[str]:
    """Raise UserError when the predicted host memory exceeds the host; return warnings for people.
    densest_row_samples: counted in the built data (loader.densest_row_samples)."""
    try:
        with loaded.sources.located():
            plan = plan_recipe(
                loaded.recipe, exact_pinned=exact_pinned, name=loaded.name, densest_row_samples=densest_row_samples
            )
    except UserError:
        raise
    except Exception as error:  # noqa: BLE001 — the plan advises; a model it cannot trace still trains
        return [f"memtrain plan could not model this recipe ({type(error).__name__}: {error}); no memory check"]
    capacity = host_capacity_bytes(loaded)
    # the plan's host bytes are already this node's (its `hardware.gpus` processes, each with its share of
    # what ZeRO partitions over every node); multiplying them by the GPU count again counted them twice
    if plan.host_bytes > capacity:
        raise UserError(
            loaded.sources.problem(
                ("offload",),
                f"the run needs about {gib(plan.host_bytes):.1f} GiB of host memory"
                f"{' on each node' if loaded.recipe.hardware.nodes > 1 else ''} "
                f"({', '.join(f'{k} {gib(v):.1f}' for k, v in plan.host_breakdown.items() if v)} GiB), "
                f"more than the {gib(capacity):.1f} GiB available",
                _cheapest_host_change(loaded, capacity, exact_pinned),
            )
        )
    warnings = []
    if not plan.fits and plan.host_fits:
        warnings.append(
            f"memtrain plan predicts {gib(plan.peak_reserved_bytes):.1f} GiB peak on a "
            f"{gib(plan.gpu_capacity_bytes):.0f} GiB card; the batch policy will shrink on OOM — "
            "`memtrain plan --fit` finds a recipe that fits"
        )
    return warnings


def _cheapest_host_change(loaded: LoadedRecipe, capacity: int, exact_pinned: bool) -> str:
    """The hint of a host-memory refusal: the cheapest change `memtrain plan --fit` finds for this host (seconds of
    planning, only when the run is refused anyway), or the usual levers when none fits."""
    at_capacity = with_overrides(loaded, [f"hardware.host_memory={capacity}"])
    advice = advise(at_capacity, limit=1, exact_pinned=exact_pinned, checks=recipe_checks(current_environment()))
    if advice:
        return (
            f"the cheapest change that fits: {' '.join(advice[0].overrides)} ({advice[0].reason}); "
            "`memtrain plan --fit -o FILE` writes it"
        )
    return (
        f"put optimizer states on NVMe under ZeRO-3 ({' '.join(NVME_OPTIMIZER)} hardware.nvme_path=DIR), use "
        "precision.master=bf16 with the states on the CPU, or train LoRA adapters; `memtrain plan` shows the "
        "breakdown"
    )


def cpu_fp16_supported() -> bool:
    """Whether DeepSpeed's CPU accelerator takes fp16 here (it needs oneDNN fp16: AVX512-FP16 / AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def check_dtype(loaded: LoadedRecipe) -> None:
    """Raise UserError for fp16 on a CPU whose DeepSpeed accelerator refuses it (before any work)."""
    if loaded.recipe.precision.compute != "fp16" or torch.cuda.is_available() or cpu_fp16_supported():
        return
    raise UserError(
        loaded.sources.problem(
            ("precision", "compute"),
            "fp16 is not supported by DeepSpeed on this CPU (it needs AVX512-FP16 or AMX)",
            "use precision.compute=bf16 (or fp32) for runs on this machine",
        )
    )
