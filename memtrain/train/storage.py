"""Disk space for checkpoints: warn before a save that may not fit; end cleanly when one does not.

A checkpoint is about as large as the previous one (the model, the optimizer states and a few small
files), or before the first save, as the parameters and the optimizer's states as the planner counts them
(memtrain.plan.model_states.optimizer_bytes_per_param: a master copy unless the weights are their own, and
Adam's two moments, 8-bit where the optimizer keeps them so).
Before each save the free space of the run directory's disk is compared with that; below
`WARN_BELOW_SAVES` checkpoints' worth a warning goes out (an event in metrics.jsonl and a line), early
enough to make room. A save that still runs out of space (ENOSPC, or torch's C++ writer failing on a
full disk) has its partial directory removed, the metrics flushed, and ends with exit 2 and
"no space left on ... (needs ~N GB)"; the last complete checkpoint is untouched.
"""
from __future__ import annotations

import errno
import os
import shutil
import sys
from pathlib import Path

from memtrain.errors import Problem, UserError
from memtrain.train.checkpoint import latest_checkpoint

WARN_BELOW_SAVES = 2.0      # warn when the disk holds fewer than this many more checkpoints
_FULL_DISK_FRAGMENTS = ("no space left", "file write failed", "unexpected pos")  # torch's writer on a full disk


def free_bytes(path: Path) -> int:
    """Free bytes on the disk that holds `path` (or its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def expected_checkpoint_bytes(run_dir: Path, model, optimizer_bytes_per_param: float) -> int:
    """The previous checkpoint's size, else the parameters plus the trainable ones' optimizer states
    (`optimizer_bytes_per_param` per trainable element). A flat 12 bytes (fp32 master and moments) put the 7B
    full fine-tune with paged 8-bit AdamW in backward at ~94 GB; its checkpoint took 26 GiB (4.03 bytes per
    parameter priced: ~27 GB)."""
    previous = latest_checkpoint(run_dir)
    if previous is not None:
        return directory_bytes(previous)
    total = 0.0
    for p in model.parameters():
        numel = getattr(p, "ds_numel", p.numel())  # ZeRO-3 keeps the full size here
        total += numel * (p.element_size() + (optimizer_bytes_per_param if p.requires_grad else 0))
    return int(total)


def space_warning(run_dir: Path, needed: int) -> tuple[int, str | None]:
    """(free bytes, a warning when fewer than WARN_BELOW_SAVES checkpoints of `needed` bytes fit, else None)."""
    free = free_bytes(run_dir)
    if free >= WARN_BELOW_SAVES * needed:
        return free, None
    verdict = "the next save will not fit" if free < needed else "room for one more save"
    return free, (f"{_gb(free)} free on the disk of {run_dir}, a checkpoint takes ~{_gb(needed)}: {verdict} — "
                  "make room, or lower train.keep_last")


def is_disk_full(error: BaseException) -> bool:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno == errno.ENOSPC:
            return True
        if isinstance(current, RuntimeError) and any(f in str(current).lower() for f in _FULL_DISK_FRAGMENTS):
            return True
        current = current.__cause__ or current.__context__
    return False


def disk_full_error(run_dir: Path, needed: int, step: int) -> UserError:
    return UserError(Problem(
        f"no space left on {_mount_of(run_dir)} while saving the checkpoint of step {step} "
        f"(needs ~{_gb(needed)}, {_gb(free_bytes(run_dir))} free); the partial save was removed and the last "
        "complete checkpoint kept", key="train.output_dir",
        hint="make room (or lower train.keep_last) and run the same command to resume, or point "
             "train.output_dir at a larger disk"))


def inject_enospc(tmp: Path) -> None:
    """Test hook (MEMTRAIN_INJECT_ENOSPC): a save that fails half-way, as on a full disk."""
    (tmp / "half-written.bin").write_bytes(b"\0" * 4096)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))


def say(text: str) -> None:
    print(f"! {text}", file=sys.stderr, flush=True)


def _mount_of(path: Path) -> Path:
    path = Path(path).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def _gb(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.1f} GB" if n < 10e9 else f"{n / 1e9:.0f} GB"
