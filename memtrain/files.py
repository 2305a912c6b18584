"""Files written whole or not at all: every file and directory memtrain writes goes through here.

A reader (a resumed run, `memtrain report`, another run sharing the token cache) sees the old
content or the new, never half of it: the writer fills a temporary path beside the target, which is
renamed onto the target only when the writing finished, and removed when it failed.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from memtrain.errors import Problem, UserError
from memtrain.units import gib

_TMP, _ASIDE = ".tmp", ".old"  # atomic_path's temporaries, and an old directory on its way out
_FULL_DISK_FRAGMENTS = ("no space left", "file write failed", "unexpected pos")  # torch's writer on a full disk
# Rust's io::Error in an exception's text
# (safetensors' SafetensorError: "I/O error: No space left on device (os error 28)")
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
_COPY_ERRNO = re.compile(r"\[Errno (\d+)\]")  # shutil.copytree's Error: each file's failure as text, no errno
# what only a write fails with: an output's own failure, never the reading of an input inside the same block
_WRITE_ONLY_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})


@contextmanager
def atomic_path(path: Path, directory: bool = False) -> Iterator[Path]:
    """A temporary file (or, with `directory`, an empty directory) beside `path` to write into;
    it replaces `path` when the block ends and is removed if the block raises.

    A directory that already exists at `path` is renamed aside before the new one is renamed in, and
    deleted only then: at every moment one of the two is whole, and `path` is never half-deleted (a
    run checks that final/ is a directory to tell that it is done). A kill leaves the temporaries
    (`leftovers` finds them)."""
    path = Path(path)
    prefix, suffix = f".{path.name}.", _TMP
    made = [folder for folder in path.parents if not folder.exists()]  # nearest first
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if directory:
            tmp = _new_directory(path.parent, prefix, suffix)
        else:
            handle, name = tempfile.mkstemp(dir=path.parent, prefix=prefix, suffix=suffix)
            os.close(handle)
            tmp = Path(name)
    except OSError as error:  # nothing written yet: say what is in the way instead of a traceback
        _remove_empty(made)  # and leave no empty folders behind
        raise UserError(cannot_create(path, error)) from None
    try:
        yield tmp
        if directory:
            _replace_directory(tmp, path, prefix)
        else:
            os.chmod(tmp, 0o644)  # mkstemp makes 0600; other users' runs may share a cache or read a report
            with open(tmp, "rb") as written:
                os.fsync(written.fileno())
            os.replace(tmp, path)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        _remove_empty(made)
        raise


def _replace_directory(tmp: Path, path: Path, prefix: str) -> None:
    """Put the directory `tmp` at `path`: an old `path` goes aside whole first (os.replace cannot replace a
    non-empty directory), the new one comes in, and only then is the old one deleted."""
    if not path.exists():
        os.replace(tmp, path)
        return
    aside = _unused_name(path.parent, prefix, _ASIDE)
    os.replace(path, aside)
    try:
        os.replace(tmp, path)
    except BaseException:
        if not path.exists():
            os.replace(aside, path)  # the old one back: the write failed, the target is as it was
        raise
    if aside.is_dir():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink(missing_ok=True)


def leftovers(path: Path) -> list[Path]:
    """What atomic_path left beside `path` when its process was killed: temporaries that were never renamed
    onto `path`, and old directories renamed aside and not yet deleted. Only names atomic_path makes."""
    path = Path(path)
    return _left_in(path.parent, re.escape(path.name))


def leftovers_in(directory: Path) -> list[Path]:
    """What atomic_path left in `directory` for any path, as `leftovers` finds for one."""
    return _left_in(Path(directory), r".+")


def _left_in(directory: Path, name: str) -> list[Path]:
    # _new_directory's and _unused_name's 12 hex digits, or tempfile.mkstemp's 8 characters
    pattern = re.compile(rf"\.{name}\.(?:[0-9a-f]{{12}}\.(?:tmp|old)|[a-z0-9_]{{8}}\.tmp)")
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if pattern.fullmatch(p.name))


def _remove_empty(folders: list[Path]) -> None:
    """Remove the folders a failed write made (nearest first), where nothing else was put in them meanwhile."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def _new_directory(parent: Path, prefix: str, suffix: str) -> Path:
    """An empty directory of a fresh name in `parent`, made as os.makedirs makes one (0777 less the umask):
    it becomes the target (final/, merged/, an export), which others may need to read; mkdtemp makes 0700."""
    for candidate in _fresh_names(parent, prefix, suffix):
        try:
            candidate.mkdir()  # claims the name: another writer's mkdir of it fails
            return candidate
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(parent))


def _unused_name(parent: Path, prefix: str, suffix: str) -> Path:
    """A fresh name in `parent` that nothing holds now (an old directory is renamed onto it)."""
    candidate = next((c for c in _fresh_names(parent, prefix, suffix) if not os.path.lexists(c)), None)
    if candidate is None:
        raise FileExistsError(errno.EEXIST, "no free temporary name", str(parent))
    return candidate


def _fresh_names(parent: Path, prefix: str, suffix: str, tries: int = 100) -> Iterator[Path]:
    """Random names `prefix` + 12 hex digits + `suffix` in `parent` (the form `leftovers` recognises)."""
    for _ in range(tries):
        yield parent / f"{prefix}{secrets.token_hex(6)}{suffix}"


def cannot_create(path: Path, error: OSError) -> Problem:
    """What stops `path` from being created (its folders, or a temporary file beside it), and what to do."""
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        return Problem(
            f"cannot create '{path}': '{blocker}' is a file, where a directory is needed",
            hint=f"choose a path whose folders are directories, or move '{blocker}' aside",
        )
    folder = next((p for p in path.parents if p.is_dir()), path.parent)
    if isinstance(error, PermissionError):
        return Problem(
            f"cannot create '{path}': no permission to create files in '{folder}'",
            hint="choose a directory you can write to, or change its permissions",
        )
    if error.errno == errno.EROFS:
        return Problem(
            f"cannot create '{path}': '{folder}' is on a read-only filesystem",
            hint="choose a path on a writable filesystem",
        )
    if error.errno == errno.ENOSPC:
        return Problem(
            f"cannot create '{path}': no space left on the filesystem of '{folder}'",
            hint="free some space there, or choose a path on another filesystem",
        )
    return Problem(
        f"cannot create '{path}' in '{folder}': {error.strerror or error}",
        hint="choose a path in an ordinary writable directory",
    )


def write_atomically(path: Path, content: str | bytes) -> None:
    """Write a whole file or nothing."""
    with atomic_path(path) as tmp:
        if isinstance(content, bytes):
            tmp.write_bytes(content)
        else:
            tmp.write_text(content)


@contextmanager
def directory_atomically(path: Path) -> Iterator[Path]:
    """atomic_path for a directory that must not hold anything yet (an output a user names): a non-empty
    `path` is refused (UserError), so nothing a user made is ever replaced. Enter it before long work: what
    would stop the write (the path taken, a file in the way, no permission) is said before the work starts.
    A write that fails inside the block on a full disk, a quota, a read-only filesystem or a file size limit is
    said as cannot_create says it (UserError), the partial output removed.
    """
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise UserError(
            Problem(
                f"the output directory '{path}' already exists and is not empty",
                hint="choose a new directory, or remove this one first",
            )
        )
    with atomic_path(path, directory=True) as tmp:
        try:
            yield tmp
        except Exception as error:
            found = write_error(error)
            if found is None or found.errno not in _WRITE_ONLY_ERRNOS:
                raise
            problem = cannot_create(path, found)
            raise UserError(Problem(f"{problem.message}; the partial output was removed", hint=problem.hint)) from None


def require_space(path: Path, needed_bytes: int, what: str) -> None:
    """Refuse (UserError) to write `needed_bytes` of `what` at `path` when its disk has less free: said before
    the disk fills, rather than by the write that fills it."""
    free = free_bytes(path)
    if free < needed_bytes:
        folder = next((p for p in Path(path).parents if p.exists()), Path(path).parent)
        raise UserError(
            Problem(
                f"not enough space for {what} at '{path}': it takes ~{gib(needed_bytes):.1f} GiB and the disk of "
                f"'{folder}' has {gib(free):.1f} GiB free",
                hint="free some space there, or write to another disk (-o DIR)",
            )
        )


def directory_bytes(path: Path) -> int:
    """The bytes of the files under `path`."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def free_bytes(path: Path) -> int:
    """Free bytes on the disk that holds `path` (or its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def write_error(error: BaseException) -> OSError | None:
    """The OSError behind a failed write, if one is: raised as such, as a cause or context, as torch's C++ writer
    says a full disk (a RuntimeError without errno), in Rust's words (safetensors: "... (os error 28)"), or in
    copytree's list of failed files (the first)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and not isinstance(current, ConnectionError) and current.errno is not None:
            return current  # a broken connection to another rank is not the disk's doing
        text = str(current)
        found = _RUST_OS_ERROR.search(text) or (_COPY_ERRNO.search(text) if isinstance(current, shutil.Error) else None)
        if found:
            code = int(found.group(1))
            return OSError(code, os.strerror(code))
        if isinstance(current, RuntimeError) and any(f in text.lower() for f in _FULL_DISK_FRAGMENTS):
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        current = current.__cause__ or current.__context__
    return None


def digest_file(digest, path: Path, block_bytes: int = 1 << 20) -> None:
    """Feed a file's bytes to a hashlib digest, a block at a time (data files can be larger than memory)."""
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(block_bytes), b""):
            digest.update(block)
