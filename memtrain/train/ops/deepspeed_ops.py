"""DeepSpeed's C++ ops that a run of a recipe loads, and building them ahead of the run (`memtrain prepare`).

DeepSpeed builds its ops with the machine's C++ compiler on first use, into torch's extension cache
(op_locks.extensions_root), unless they were built when DeepSpeed was installed (DS_BUILD_OPS=1). A run
of a recipe loads:
- CPU Adam, when DeepSpeed steps an optimizer offloaded to the CPU or NVMe (`needs_cpu_adam`):
  33.2-43.3 s of a first start on the GPU machine, 46.7 s on two cores (benchmarks/startup.csv);
- async I/O, when a tier lives on NVMe (it needs libaio);
- the shared-memory collectives, on a machine without a GPU (DeepSpeed's CPU accelerator loads them
  when the process group starts).
Built once, each later load takes a second or two; `build` says which were built now.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from memtrain.ds_config.compiler import uses_client_optimizer
from memtrain.errors import Problem, UserError
from memtrain.recipe.schema import Recipe
from memtrain.train.ops.locks import extensions_root


@dataclass(frozen=True)
class Op:
    name: str  # DeepSpeed's name for it, which names its folder in the extension cache
    builder: str  # the accelerator's op builder class
    why: str  # what the run uses it for, for people
    key: str  # the recipe key that asks for it
    hint: str  # what to do when it cannot be built


COMPILER = "DeepSpeed builds it with this machine's C++ compiler and ninja (install g++, or point CXX at a working one)"
CPU_ADAM = Op(
    "cpu_adam",
    "CPUAdamBuilder",
    "steps the offloaded optimizer",
    "offload.cpu_adam",
    f"{COMPILER}; or set offload.cpu_adam=torch: PyTorch's fused AdamW, nothing to build",
)
ASYNC_IO = Op(
    "async_io",
    "AsyncIOBuilder",
    "reads and writes the NVMe tiers",
    "offload.optimizer",
    "it needs libaio: apt-get install libaio-dev (or the distribution's libaio-devel); or keep the tiers "
    "on the CPU (offload.optimizer=cpu, offload.params=cpu)",
)
SHARED_MEMORY = Op(
    "deepspeed_shm_comm", "ShareMemCommBuilder", "the collectives of a run on the CPU", "hardware", COMPILER
)


def needs_cpu_adam(recipe: Recipe) -> bool:
    """Whether DeepSpeed builds its CPU Adam for this recipe (an offloaded optimizer it creates itself, unless
    offload.cpu_adam says PyTorch's)."""
    o = recipe.offload
    return o.optimizer != "none" and o.cpu_adam == "deepspeed" and not uses_client_optimizer(recipe)


def ops_for(recipe: Recipe, on_gpu: bool) -> list[Op]:
    """The ops a run of `recipe` loads, on a machine with (on_gpu) or without a GPU."""
    o = recipe.offload
    ops = [] if on_gpu else [SHARED_MEMORY]
    if needs_cpu_adam(recipe):
        ops.append(CPU_ADAM)
    if "nvme" in (o.optimizer, o.params):
        ops.append(
            dataclasses.replace(ASYNC_IO, key="offload.optimizer" if o.optimizer == "nvme" else "offload.params")
        )
    return ops


@dataclass(frozen=True)
class Built:
    op: Op
    state: str  # "built now", "already built" (the extension cache), "installed with DeepSpeed"
    seconds: float  # to build or load it here


def _builder(op: Op):
    from deepspeed.accelerator import get_accelerator  # noqa: PLC0415 — heavy; only when ops are built

    return get_accelerator().create_op_builder(op.builder)


def check_buildable(recipe: Recipe, on_gpu: bool) -> None:
    """Raise a UserError, before anything is built, for an op of the run that this machine cannot build (async
    I/O without libaio): DeepSpeed would find it out in deepspeed.initialize, after the model is built."""
    for op in ops_for(recipe, on_gpu):
        _checked_builder(op)


def _checked_builder(op: Op):
    builder = _builder(op)
    if builder is None or not builder.is_compatible(verbose=False):
        raise UserError(
            Problem(
                f"DeepSpeed's {op.name} op, which {op.why}, cannot be built on this machine", key=op.key, hint=op.hint
            )
        )
    return builder


def _built_at(op: Op) -> int | None:
    """When the op's library in the extension cache was last written (ns), None when it is not there."""
    library = extensions_root() / op.name / f"{op.name}.so"
    return library.stat().st_mtime_ns if library.exists() else None


def build(op: Op) -> Built:
    """Build `op` into the extension cache, or load the build already there. A machine that cannot build it
    is a UserError naming the way around it."""
    from deepspeed.git_version_info import installed_ops  # noqa: PLC0415 — heavy; only when ops are built

    builder = _checked_builder(op)
    before, started = _built_at(op), time.perf_counter()
    try:
        builder.load()
    except Exception as error:  # noqa: BLE001 — the compiler's failure, said for people
        raise op_failure(op, error) from error
    seconds = time.perf_counter() - started
    if installed_ops.get(op.name, False):
        return Built(op, "installed with DeepSpeed", seconds)
    # torch's loader rebuilds when the sources or the flags changed since the build in the cache
    return Built(op, "already built" if before is not None and _built_at(op) == before else "built now", seconds)


def op_failure(op: Op, error: Exception) -> UserError:
    """A build or load of `op` that raised `error`, as one line with its key and the way around it."""
    said = (str(error).strip().splitlines() or [""])[0]
    return UserError(
        Problem(
            f"DeepSpeed's {op.name} op, which {op.why}, could not be built or loaded ({type(error).__name__}: {said})",
            key=op.key,
            hint=op.hint,
        )
    )


def machine_has_gpu() -> bool:
    """Whether a run here trains on a GPU (setup_process's choice of device)."""
    return torch.cuda.is_available()
