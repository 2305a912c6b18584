"""Files written whole or not at all."""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """Write a whole file or nothing: a temporary file in the same directory, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as stream:
            stream.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def directory_atomically(path: Path) -> Iterator[Path]:
    """Yield a temporary directory beside `path` to fill; it becomes `path` when the block ends without
    an error, and is removed when it raises: `path` is whole or absent, never half-written.

    `path` must not exist, or be an empty directory: nothing a user made is ever replaced.
    """
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial"))
    try:
        yield tmp
        if path.exists():
            path.rmdir()  # empty, checked above
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
