"""The lock a killed build of a DeepSpeed op leaves behind, found and removed before it hangs a run.

DeepSpeed builds its C++ ops (CPU Adam, async I/O for the NVMe tier, shared-memory all-reduce) with
torch's JIT extension loader on first use, under a lock file in the op's build directory. Every later load
of the op — even of one built long ago — first takes that lock, and waits for it with no timeout. A build
that was killed (SIGKILL, a closed terminal, a stopped container) leaves the file behind, and every run
after it stops at start-up, silent, forever.

The holder keeps the lock file open from the moment it creates it until it removes it, so a lock that no
process has open, twice a second apart, was left by a process that is gone: it is removed, with a line.

PyTorch 2.14 replaced that lock file with an advisory lock (filelock) that the kernel releases when its holder
dies; its file stays on disk after every build and blocks nothing. With such a PyTorch there is nothing to
clear, and a file found there says nothing about a killed build.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def extensions_root() -> Path:
    """Where torch builds JIT extensions: $TORCH_EXTENSIONS_DIR, else its per-Python, per-accelerator cache."""
    import torch  # noqa: PLC0415 — only for the build folder's name
    from torch.utils.cpp_extension import get_default_build_root  # noqa: PLC0415

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    accelerator = (
        f"rocm{torch.version.hip.replace('.', '')}"
        if torch.version.hip
        else f"cu{torch.version.cuda.replace('.', '')}"
        if torch.version.cuda
        else "cpu"
    )
    folder = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{accelerator}"
    return Path(get_default_build_root()) / folder


def open_files() -> set[Path]:
    """Every file some process of this machine has open that this user may see (/proc/PID/fd)."""
    found = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                try:
                    found.add(Path(os.readlink(fd)))
                except OSError:
                    continue
        except OSError:  # another user's process, or one that just ended
            continue
    return found


def stale_locks(root: Path, recheck_s: float = 1.0) -> list[Path]:
    """The op build locks under `root` that no process holds (seen so twice, `recheck_s` apart)."""
    locks = sorted(root.glob("*/lock"))
    if not locks or not Path("/proc/self/fd").is_dir():
        return []  # nothing to do, or no way to tell a held lock from a left one
    held = open_files()
    candidates = [lock for lock in locks if lock.resolve() not in held]
    if not candidates:
        return []
    time.sleep(recheck_s)  # a holder releasing closes the file, then removes it: let it finish
    held = open_files()
    return [lock for lock in candidates if lock.exists() and lock.resolve() not in held]


def builds_leave_lock_files() -> bool:
    """Whether torch's extension loader locks a build with a file whose existence blocks (PyTorch < 2.14's
    FileBaton), which a killed build leaves behind."""
    from torch.utils import cpp_extension  # noqa: PLC0415 — heavy; only when ops are loaded

    return hasattr(cpp_extension, "FileBaton")


def clear_stale_locks(root: Path | None = None) -> list[Path]:
    """Remove the locks killed builds left; returns them, after saying so on stderr. Nothing to do where torch
    locks builds with advisory locks."""
    if not builds_leave_lock_files():
        return []
    root = root or extensions_root()
    removed = []
    for lock in stale_locks(root):  # a root not there yet globs to nothing
        lock.unlink(missing_ok=True)
        removed.append(lock)
        print(
            f"! removed {lock}: a build of DeepSpeed's {lock.parent.name} op was killed and left it, and every "
            "later start would wait on it forever; the op is rebuilt or reloaded now",
            file=sys.stderr,
            flush=True,
        )
    return removed
