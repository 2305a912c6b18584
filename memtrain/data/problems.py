"""The problems of one data file, reported together: the first MAX_PROBLEMS in file order, and how many more.

More than ten would bury the first ones; cutting at ten without a count would hide that the file holds more (a
user fixes ten, runs again and meets ten others). Readers add the problems of bad lines as they read (invalid
JSON, a line that is not an object) and callers add those of the fields they convert, into one `FileProblems`,
so a bad line early in a file is reported before a bad field later, whichever layer found it.
"""
from __future__ import annotations

from memtrain.errors import DataError, Problem

MAX_PROBLEMS = 10


class FileProblems:
    """Problems of the file `spec`, added in file order; `raise_if_any` raises them as one DataError."""

    def __init__(self, spec: str, limit: int = MAX_PROBLEMS):
        self.spec, self.limit = spec, limit
        self.kept: list[Problem] = []
        self.more = 0  # found after the first `limit`: counted, not kept

    def add(self, *problems: Problem) -> None:
        for problem in problems:
            if len(self.kept) < self.limit:
                self.kept.append(problem)
            else:
                self.more += 1

    def __bool__(self) -> bool:
        return bool(self.kept)

    def raise_if_any(self) -> None:
        if not self.kept:
            return
        problems = sorted(self.kept, key=lambda p: p.line if p.line is not None else 0)
        if self.more:
            problems.append(Problem(f"… and {self.more} more problem{'s' if self.more != 1 else ''} in this file",
                                    file=self.spec, hint="fix the ones above, then check again for the rest"))
        raise DataError(problems)
