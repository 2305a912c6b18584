"""What a path that is not a regular file is, said for people: "a directory", "a named pipe (FIFO)", ...

An input named by a recipe (a data file, an `extends:` base) that exists but is not a regular file must be said as
what it is: "does not exist" sends people looking for a typo, and a FIFO or /dev/zero read as data never ends.
"""

from __future__ import annotations

import stat
from pathlib import Path

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def kind_of(path: Path | str) -> str | None:
    """What `path` is when it exists but is not a regular file (links followed), else None (a regular file, or
    nothing there: the caller says "does not exist")."""
    try:
        mode = Path(path).stat().st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")
