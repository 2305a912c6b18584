"""Errors written for people: what is wrong, where, and what to do.

Every error a user can cause by their input (a recipe, a data file, a command-line flag) is a
`UserError`. The CLI prints it and exits with code 2, never with a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an input."""

    message: str
    key: str = ""  # dotted key path in the recipe, e.g. "batch.micro_batch"
    file: str = ""  # file the key came from ("<command line>" for overrides)
    line: int | None = None
    hint: str = ""  # what to do about it

    def location(self) -> str:
        where = self.file or ""
        if self.line is not None:
            where = f"{where}:{self.line}" if where else f"line {self.line}"
        return where

    def format(self) -> str:
        parts = []
        where = self.location()
        if where:
            parts.append(where)
        if self.key:
            parts.append(self.key)
        head = ": ".join(parts)
        text = f"{head}: {self.message}" if head else self.message
        if self.hint:
            text += f" — {self.hint}"
        return text


class UserError(Exception):
    """Input that cannot be used as given. Holds one or more problems, reported together."""

    exit_code = 2

    def __init__(self, problems: list[Problem] | Problem | str, count: str | None = None):
        if isinstance(problems, str):
            problems = [Problem(problems)]
        elif isinstance(problems, Problem):
            problems = [problems]
        self.problems: list[Problem] = list(problems)
        # how many problems there are, for the headline, where the list holds only the first and a line for the rest
        self.count = count or f"{len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}"
        super().__init__("\n".join(p.format() for p in self.problems))


class RecipeError(UserError):
    """A recipe that does not validate (syntax, unknown keys, types, ranges, contradictions)."""


class DataError(UserError):
    """Training or validation data that cannot be used."""
