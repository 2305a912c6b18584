"""The problems of one data file, reported together: the first MAX_PROBLEMS in file order, and how many more.

More than ten would bury the first ones; cutting at ten without a count would hide that the file holds more (a
user fixes ten, runs again and meets ten others). Readers add the problems of bad lines as they read (invalid
JSON, a line that is not an object) and callers add those of the fields they convert, into one `FileProblems`,
so a bad line early in a file is reported before a bad field later, whichever layer found it. A costly check
(tokenising chat records: minutes for a large file) stops once MAX_PROBLEMS are kept and says after which line, so
a template that cannot write some records is said in seconds, not after the whole file.
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
        self.stopped_after: int | None = None  # the line checking stopped after, when it stopped early (stop_after)

    def add(self, *problems: Problem) -> None:
        for problem in problems:
            if len(self.kept) < self.limit:
                self.kept.append(problem)
            else:
                self.more += 1

    def __bool__(self) -> bool:
        return bool(self.kept)

    @property
    def full(self) -> bool:
        """`limit` problems are kept: a costly check may stop here (stop_after) rather than count the rest."""
        return len(self.kept) >= self.limit

    def stop_after(self, line: int) -> None:
        """Checking ended early after `line`: the report says the lines after it were not checked."""
        self.stopped_after = line

    def raise_if_any(self) -> None:
        if not self.kept:
            return
        problems = sorted(self.kept, key=lambda p: p.line if p.line is not None else 0)
        total = len(self.kept) + self.more
        count = None  # the headline's: the problems listed, unless there are more (not "11 problems" for 400)
        if self.more or self.stopped_after is not None:
            count = (
                f"{'at least ' if self.stopped_after is not None else ''}{total} problems, the first "
                f"{len(self.kept)} listed"
            )
        if self.stopped_after is not None:
            found = f"{self.more} more problem{'s' if self.more != 1 else ''} up to there, " if self.more else ""
            problems.append(
                Problem(
                    f"… checking stopped after line {self.stopped_after} ({found}the lines after it were not checked)",
                    file=self.spec,
                    hint="fix the ones above, then check again for the rest",
                )
            )
        elif self.more:
            problems.append(
                Problem(
                    f"… and {self.more} more problem{'s' if self.more != 1 else ''} in this file",
                    file=self.spec,
                    hint="fix the ones above, then check again for the rest",
                )
            )
        raise DataError(problems, count)
