"""A data file's fingerprint, hashed once per version of the file and remembered by its stat identity.

The token cache is keyed by a sha256 of the data files' bytes (cache.py, tokenized.py), so every start used to
read and hash each data file again before it could find its cache entry: two or three times per process (the
build, the data warnings, the held-out answers) and again in each worker. A fingerprint is now remembered, in
this process and in a small file under the token cache, by what identifies that version of the files, as git's
index does: each file's name as given and resolved path, device, inode, size, mtime_ns and ctime_ns. Any write to a
file changes its ctime, which no user can set back, so a changed file is hashed again. Two things are never remembered:
- files changed less than RACY_S before the hash began (a write within the same clock tick could keep the stat
  identity while changing the bytes);
- files whose identity changed while they were hashed.
What is remembered is the fingerprint itself, so cache keys are the same as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

MEMO_DIR = "fingerprints"  # under the token cache directory
RACY_S = 2.0
_remembered: dict[str, str] = {}


def remembered_fingerprint(files: list[Path], salt: str, compute: Callable[[], str], memo_root: Path | None) -> str:
    """compute() (a fingerprint of `files`' bytes and of `salt`), unless this version of the files has one."""
    started = time.time()
    try:
        identity, newest_change = _identity(files, salt)
    except OSError:
        return compute()  # it reads the files and says what is wrong with them
    if identity in _remembered:
        return _remembered[identity]
    memo = memo_root / MEMO_DIR / identity if memo_root is not None else None
    value = _read(memo)
    if value is not None:
        _remembered[identity] = value
        return value
    value = compute()
    try:
        unchanged = _identity(files, salt)[0] == identity
    except OSError:
        unchanged = False
    if unchanged and newest_change < started - RACY_S:
        _remembered[identity] = value
        _write(memo, value)
    return value


def forget() -> None:
    """Drop what this process remembers (the files under the token cache stay)."""
    _remembered.clear()


def _identity(files: list[Path], salt: str) -> tuple[str, float]:
    """(sha256 of the salt and every file's path and stat identity, the newest mtime or ctime in seconds)."""
    digest = hashlib.sha256(salt.encode())
    newest = 0.0
    for file in files:
        path = Path(file).resolve()  # the name as given too: a renamed link keeps its target's identity
        stat = os.stat(path)
        digest.update(
            f"\0{file}\0{path}\0{stat.st_dev}:{stat.st_ino}:{stat.st_size}:{stat.st_mtime_ns}:"
            f"{stat.st_ctime_ns}".encode()
        )
        newest = max(newest, stat.st_mtime_ns / 1e9, stat.st_ctime_ns / 1e9)
    return digest.hexdigest(), newest


def _read(memo: Path | None) -> str | None:
    if memo is None:
        return None
    try:
        value = memo.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return value if len(value) == 64 and all(c in "0123456789abcdef" for c in value) else None


def _write(memo: Path | None, value: str) -> None:
    """Best effort, whole or not at all: a cache that cannot be written only means hashing again next time."""
    if memo is None:
        return
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        handle, tmp = tempfile.mkstemp(dir=memo.parent, prefix=f".{memo.name}.")
    except OSError:
        return
    try:
        with os.fdopen(handle, "w") as stream:
            stream.write(value)
        os.chmod(tmp, 0o644)  # as the cache's entries: other users of a shared cache read it too
        os.replace(tmp, memo)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
