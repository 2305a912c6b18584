"""Out-of-memory helpers: recognise an OOM, free what it left, keep forensics, inject OOMs in tests."""

from __future__ import annotations

import gc
import logging
import re
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from memtrain.errors import Problem, UserError
from memtrain.model.layers import decoder_layer_names, hf_model

log = logging.getLogger(__name__)

INJECT_ENV = "MEMTRAIN_INJECT_OOM"
HISTORY_MAX_ENTRIES = 100_000  # alloc/free events kept for a snapshot; bounds the host memory it costs

# Lower-cased fragments of messages that mean "an allocation failed", from places that raise a plain
# RuntimeError rather than torch.OutOfMemoryError: CUDA runtime calls, cuBLAS/cuDNN handle and
# workspace creation, NCCL, DeepSpeed's pinned/offload buffers, and torch's CPU allocator.
_OOM_FRAGMENTS = (
    "out of memory",
    "cublas_status_alloc_failed",
    "cudnn_status_alloc_failed",
    "cudnn_status_not_enough_workspace",
    "can't allocate memory",
    "cannot allocate memory",
)


def _chain(error: BaseException):
    """`error` and the errors it was raised from (cause, else context), each once."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def is_oom(error: BaseException) -> bool:
    """True when `error` (or an error it was raised from) is a failed memory allocation.

    Python's MemoryError counts too: on CPU runs activations live in host memory.
    """
    for current in _chain(error):
        if isinstance(current, (torch.OutOfMemoryError, MemoryError)):
            return True
        if isinstance(current, RuntimeError) and any(f in str(current).lower() for f in _OOM_FRAGMENTS):
            return True
    return False


def _on_cuda(device) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def start_memory_history(device) -> None:
    """Record allocator events on CUDA so that an OOM snapshot shows who held what; no-op elsewhere."""
    if _on_cuda(device):
        # no tracebacks (context=None): capturing Python stacks inside autograd's backward thread
        # failed with "cross_entropy_loss returned NULL" on torch 2.11; block sizes and order remain
        torch.cuda.memory._record_memory_history(max_entries=HISTORY_MAX_ENTRIES, context=None)


def dump_memory_snapshot(run_dir: Path, step: int) -> Path | None:
    """Write the CUDA allocator snapshot to run_dir/oom-step{step}.pickle; None on CPU or on failure.

    Open the file at https://pytorch.org/memory_viz. A failure to write is logged, never raised:
    forensics must not turn a recoverable OOM into a crash.
    """
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    path = Path(run_dir) / f"oom-step{step}.pickle"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
    except Exception as error:  # noqa: BLE001 — any failure here is secondary to the OOM itself
        log.warning("could not write the memory snapshot %s: %s", path, error)
        return None
    return path


def abandon_failed_frames(error: BaseException) -> None:
    """Free the finished frames an OOM unwound through, now rather than at the next garbage collection.

    They hold the failed attempt's activations, and on torch < 2.13 a non-reentrant
    `torch.utils.checkpoint` that raised keeps its saved-tensor hooks installed until its frame is
    freed: the retried forward then saved its tensors into the failed region, and its backward
    stopped with a CheckpointError (seen on a 7B LoRA run under a 24 GiB cap, torch 2.11).
    Frames still running (the handler's and its callers') are left alone.
    """
    for current in _chain(error):
        traceback.clear_frames(current.__traceback__)


def release_memory(device) -> None:
    """Drop what a failed step left reachable only through cycles, and return cached blocks to CUDA."""
    gc.collect()
    if _on_cuda(device):
        torch.cuda.empty_cache()


# -- injection for tests --------------------------------------------------------------------------

_POINT = re.compile(
    r"^(?P<step>\d+):(?P<micro>\d+)(?:\*(?P<times>\d+))?(?::mb(?P<op>>=|<=|==|>|<)(?P<size>\d+))?"
    r"(?:@layer(?P<layer>\d+))?$"
)
_COMPARE = {
    ">=": lambda a, b: a >= b,
    "<=": lambda a, b: a <= b,
    "==": lambda a, b: a == b,
    ">": lambda a, b: a > b,
    "<": lambda a, b: a < b,
}


@dataclass(frozen=True)
class InjectionPoint:
    """Raise at (optimizer step, micro-batch index) `times` times, when micro_batch satisfies `op size`.

    With `layer`, the error comes from inside that decoder layer's forward (from its last child
    module, so inside any checkpointed region around the layer) instead of before the forward.
    """

    step: int
    micro_index: int
    times: int = 1
    op: str | None = None
    size: int | None = None
    layer: int | None = None

    def matches(self, step: int, micro_index: int, micro_batch: int) -> bool:
        if (step, micro_index) != (self.step, self.micro_index):
            return False
        return self.op is None or _COMPARE[self.op](micro_batch, self.size)


class OomInjector:
    """Test hook: raises torch.OutOfMemoryError at chosen points; each point fires `times` times (default once).

    Spec, comma-separated: `step:micro_index`, optionally `*times`, `:mb>=N` (also >, <=, <, ==) and
    `@layerK`, e.g. "3:0,7:1", "3:0:mb>=4" (only while the micro-batch is at least 4), "2:0*3" (the
    first three attempts of step 2's first micro-batch), "1:0@layer0" (from inside decoder layer 0's
    forward; needs `attach(model)`). Steps count as the loop counts them.
    """

    def __init__(self, points: list[InjectionPoint] | tuple[InjectionPoint, ...] = ()):
        self.points = tuple(points)
        self.fired = [0] * len(self.points)
        self.armed: tuple[int, str] | None = None  # (layer, message) for the next forward of that layer
        self.layers = sorted({point.layer for point in self.points if point.layer is not None})  # @layerK points

    @classmethod
    def parse(cls, spec: str, source: str = INJECT_ENV) -> "OomInjector":
        """Build from a spec string; a malformed point raises UserError naming it."""
        points = []
        for part in (p.strip() for p in spec.split(",")):
            if not part:
                continue
            match = _POINT.match(part)
            if match is None:
                raise UserError(
                    Problem(
                        f"cannot read OOM injection point {part!r}",
                        key=source,
                        hint="write points as step:micro_index[*times][:mb>=N][@layerK], comma-separated, "
                        "e.g. '3:0,7:1:mb>=4,5:0@layer1'",
                    )
                )
            times = int(match["times"]) if match["times"] else 1
            if times < 1:
                raise UserError(
                    Problem(f"injection point {part!r} fires {times} times", key=source, hint="use *1 or more")
                )
            size = int(match["size"]) if match["size"] else None
            layer = int(match["layer"]) if match["layer"] else None
            points.append(InjectionPoint(int(match["step"]), int(match["micro"]), times, match["op"], size, layer))
        return cls(points)

    def __bool__(self) -> bool:
        return bool(self.points)

    def maybe_raise(self, step: int, micro_index: int, micro_batch: int) -> None:
        """Raise torch.OutOfMemoryError if a point with firings left matches; call before each micro-batch."""
        for index, point in enumerate(self.points):
            if self.fired[index] < point.times and point.matches(step, micro_index, micro_batch):
                self.fired[index] += 1
                message = (
                    f"CUDA out of memory (injected by {INJECT_ENV} at step {step}, micro-batch "
                    f"{micro_index}, micro_batch {micro_batch}, firing {self.fired[index]} of {point.times})"
                )
                if point.layer is not None:
                    self.armed = (point.layer, message)
                    return
                raise torch.OutOfMemoryError(message)

    def attach(self, model: torch.nn.Module) -> None:
        """For `@layerK` points: hook the last child of each layer named so an armed point raises there."""
        if not self.layers:
            return

        modules, names = dict(hf_model(model).named_modules()), decoder_layer_names(model)
        self.check_layers(len(names))
        for index in self.layers:
            last_child = list(modules[names[index]].children())[-1]
            last_child.register_forward_pre_hook(lambda module, args, index=index: self._raise_if_armed(index))

    def check_layers(self, num_layers: int) -> None:
        """A `@layerK` point beyond the model's decoder layers is a user error naming the valid range."""
        if self.layers and self.layers[-1] >= num_layers:
            message = f"OOM injection point @layer{self.layers[-1]}: the model has {num_layers} decoder layers"
            raise UserError(Problem(message, key=INJECT_ENV, hint=f"use @layer0 to @layer{num_layers - 1}"))

    def _raise_if_armed(self, layer: int) -> None:
        if self.armed is not None and self.armed[0] == layer:
            message, self.armed = self.armed[1], None
            raise torch.OutOfMemoryError(message)
