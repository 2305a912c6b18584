"""Disk space for checkpoints: warn before a save that may not fit; end cleanly when one does not.

A checkpoint is about as large as the previous one (the model, the optimizer states and a few small
files), or before the first save, as the trainable parameters (a frozen base is not saved: frozen_base.py) and the
optimizer's states as DeepSpeed writes them
(`saved_optimizer_bytes_per_param`: Adam's two moments, 8-bit where the optimizer keeps them so, and the master
partition DeepSpeed's ZeRO optimizer saves even where the fp32 weights are their own master), plus each rank's RNG
state and the small files of every checkpoint.
Before each save the free space of the run directory's disk is compared with that; below
`WARN_BELOW_SAVES` checkpoints' worth a warning goes out (an event in metrics.jsonl and a line), early
enough to make room. A save that still runs out of space (ENOSPC, or torch's C++ writer failing on a
full disk) has its partial directory removed, the metrics flushed, and ends with exit 2 and
"no space left on ... (needs ~N GB)"; the last complete checkpoint is untouched. So does a save that
cannot write for another reason (a read-only filesystem, no permission: `save_failed`), and the export
of the final model, which writes as much as a checkpoint's weights.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import sys
from collections.abc import Callable
from pathlib import Path

from memtrain.errors import Problem, UserError
from memtrain.files import cannot_create, directory_bytes, free_bytes, write_error
from memtrain.plan.model_states import master_bytes, optimizer_bytes_per_param
from memtrain.train.state.checkpoint import checkpoint_dir, kept_while_saving, latest_checkpoint, step_of_name
from memtrain.train.state.frozen_base import has_frozen_parameters, quantisation_entries

WARN_BELOW_SAVES = 2.0  # warn when the disk holds fewer than this many more checkpoints
# What every checkpoint holds besides the tensors: DeepSpeed's zero_to_fp32.py (38.6 kB) and zero_to_torch.py
# (2.5 kB), memtrain_state.json (3.5 kB with a batch policy), `latest`; measured on a tiny run, rounded up.
CHECKPOINT_FILES_BYTES = 64 * 1024
RNG_FILE_BYTES = 16 * 1024  # each rank's rng-rankN.pt: the CPU generator's 5 kB state, numpy's, Python's (14.5 kB)


def saved_optimizer_bytes_per_param(
    storage: str, master: str, *, zero_stage: int, eight_bit: bool = False, in_backward: bool = False
) -> float:
    """Bytes a checkpoint writes per trainable parameter for the optimizer: Adam's moments, and the master partition
    (`single_partition_of_fp32_groups`, 4 bytes, or 2 with bf16 master weights) that DeepSpeed's ZeRO and bf16
    optimizers save whatever the weights' dtype: with fp32 weights the planner counts no master copy in memory,
    and the estimate was 25 % low on the tiny fp32 run (12 of 16 bytes per parameter). A plain torch optimizer (ZeRO
    stage 0 in fp32) and an update in backward save the moments only."""
    moments = optimizer_bytes_per_param(storage, master, eight_bit=eight_bit, in_backward=True)  # no master copy
    if in_backward or (zero_stage == 0 and storage == "fp32"):
        return moments
    return moments + master_bytes(storage, master)


def expected_checkpoint_bytes(run_dir: Path, model, optimizer_bytes_per_param: float, ranks: int = 1) -> int:
    """The previous checkpoint's size, else the trainable parameters and their optimizer states
    (`optimizer_bytes_per_param` per trainable element, `saved_optimizer_bytes_per_param`), each rank's RNG state and
    the small files. A flat 12 bytes (fp32 master and moments) put the 7B full fine-tune with paged 8-bit AdamW in
    backward at ~94 GB; its checkpoint took 26 GiB (4.03 bytes per parameter priced: ~27 GB)."""
    previous = latest_checkpoint(run_dir)
    if previous is not None:
        return directory_bytes(previous)
    total = 0.0
    for p in model.parameters():
        numel = getattr(p, "ds_numel", p.numel())  # ZeRO-3 keeps the full size here
        if p.requires_grad:  # a frozen base stays out of the checkpoint (frozen_base.py)
            total += numel * (p.element_size() + optimizer_bytes_per_param)
    if has_frozen_parameters(model):  # but not a quantised base's scales
        total += sum(t.numel() * t.element_size() for t in quantisation_entries(model).values())
    return int(total) + CHECKPOINT_FILES_BYTES + RNG_FILE_BYTES * ranks


def space_warning(run_dir: Path, needed: int, keep_last: int = 1) -> tuple[int, str | None]:
    """(free bytes, a warning when fewer than WARN_BELOW_SAVES checkpoints of `needed` bytes fit, else None)."""
    free = free_bytes(run_dir)
    if free >= WARN_BELOW_SAVES * needed:
        return free, None
    verdict = "the next save will not fit" if free < needed else "room for one more save"
    return free, (
        f"{_gb(free)} free on the disk of {run_dir}, a checkpoint takes ~{_gb(needed)}: {verdict} — "
        f"{_make_room(keep_last)}"
    )


def _make_room(keep_last: int) -> str:
    """What frees room for the next save. A save first prunes to kept_while_saving(keep_last) checkpoints, so a
    lower keep_last frees one only while it stays above 2; below that only the disk itself can give room."""
    if kept_while_saving(keep_last) > 1:
        return (
            f"make room, or lower train.keep_last (now {keep_last}: each one less frees a checkpoint "
            "before the next save)"
        )
    return (
        "make room on that disk (the run keeps only the checkpoint it resumes from), or move the run directory "
        "to a larger disk and point train.output_dir at it"
    )


def is_disk_full(error: BaseException) -> bool:
    found = write_error(error)
    return found is not None and found.errno == errno.ENOSPC


def disk_full_error(run_dir: Path, needed: int, step: int, keep_last: int = 1) -> UserError:
    return UserError(
        Problem(
            f"no space left on {_mount_of(run_dir)} while saving the checkpoint of step {step} "
            f"(needs ~{_gb(needed)}, {_gb(free_bytes(run_dir))} free); the partial save was removed and "
            f"{_kept(run_dir)}",
            key="train.output_dir",
            hint=f"{_make_room(keep_last)}; then run the same command to resume",
        )
    )


def save_failed(run_dir: Path, error: BaseException, step: int, needed: int, keep_last: int = 1) -> UserError | None:
    """The line for a checkpoint save that failed writing (None when `error` is no write failure): a full disk
    as `disk_full_error`, anything else (a read-only filesystem, no permission) in files.cannot_create's words,
    naming the directory and the checkpoint a resume starts from."""
    found = write_error(error)
    if found is None:
        return None
    if found.errno == errno.ENOSPC:
        return disk_full_error(run_dir, needed, step, keep_last)
    problem = cannot_create(checkpoint_dir(Path(run_dir), step), found)
    return UserError(
        dataclasses.replace(
            problem,
            key="train.output_dir",
            message=f"{problem.message}, saving the checkpoint of step {step}; the partial save was removed and "
            f"{_kept(run_dir)}",
            hint=f"{_fix(found)}, then run the same command to resume (or copy the run directory to a writable disk "
            "and point train.output_dir at it)",
        )
    )


def export_failed(run_dir: Path, out_dir: Path, error: BaseException, needed: int) -> UserError | None:
    """The line for an export of the final model that failed writing (None when `error` is no write failure).
    The checkpoint of the last step is complete, so the same command exports again without training."""
    found = write_error(error)
    if found is None:
        return None
    if found.errno == errno.ENOSPC:
        said = (
            f"no space left on {_mount_of(out_dir)} while exporting the model to {out_dir} "
            f"(needs ~{_gb(needed)}, {_gb(free_bytes(out_dir))} free)"
        )
        fix = "make room on that disk"
    else:
        said = f"{cannot_create(out_dir, found).message}, exporting the model"
        fix = _fix(found)
    last = latest_checkpoint(run_dir)
    kept = (
        f"the checkpoint of step {step_of_name(last)} ({last}) is complete" if last is not None else "nothing was saved"
    )
    return UserError(
        Problem(
            f"{said}; the partial export was removed, and {kept}",
            key="train.output_dir",
            hint=f"{fix}, then run the same command: it exports from that checkpoint without training again",
        )
    )


def _kept(run_dir: Path) -> str:
    last = latest_checkpoint(run_dir)
    if last is None:
        return "no complete checkpoint was saved before it (a new run starts from step 0)"
    return f"the last complete checkpoint, of step {step_of_name(last)} ({last.name}), kept"


def _fix(error: OSError) -> str:
    if isinstance(error, PermissionError):
        return "give this user permission to write there"
    if error.errno == errno.EROFS:
        return "make that filesystem writable again (remount it read-write)"
    return "fix what stops the write there"


def inject_write_error(code: int) -> Callable[[Path], None]:
    """Test hook (MEMTRAIN_INJECT_ENOSPC, MEMTRAIN_INJECT_EROFS): a save that fails half-way with OSError `code`,
    as on a full disk (ENOSPC) or one remounted read-only (EROFS)."""

    def fault(tmp: Path) -> None:
        (tmp / "half-written.bin").write_bytes(b"\0" * 4096)
        raise OSError(code, os.strerror(code), str(tmp))

    return fault


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
