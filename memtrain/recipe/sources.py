"""Where each key of a recipe came from, and the recipe as loaded: what turns a problem at a key path
into a message with file:line."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from memtrain.errors import Problem, UserError
from memtrain.recipe.schema import Recipe

KeyPath = tuple[str, ...]
COMMAND_LINE = "<command line>"


@dataclass
class Sources:
    """Where each key of the merged recipe came from: key path -> (file, line)."""

    origin: dict[KeyPath, tuple[str, int | None]] = field(default_factory=dict)
    recipe_file: str = ""

    def where(self, path: KeyPath) -> tuple[str, int | None]:
        """The file and line of the deepest key on `path` that has a known origin."""
        for end in range(len(path), 0, -1):
            if path[:end] in self.origin:
                return self.origin[path[:end]]
        return self.recipe_file, None

    def problem(self, path: KeyPath, message: str, hint: str = "") -> Problem:
        """A Problem located at the key path's file and line."""
        file, line = self.where(path)
        return Problem(message=message, key=".".join(path), file=file, line=line, hint=hint)

    def locate(self, error: UserError) -> UserError:
        """The same error with each problem that names a key but no file placed at that key's file:line
        (layers below the recipe, such as the planner, know key paths, not files)."""
        located = [
            self.problem(tuple(p.key.split(".")), p.message, p.hint) if p.key and not p.file else p
            for p in error.problems
        ]
        return type(error)(located)

    @contextmanager
    def located(self) -> Iterator[None]:
        """Within the block, a UserError that names a key but no file is re-raised at that key's file:line."""
        try:
            yield
        except UserError as error:
            raise self.locate(error) from None

    def forget_below(self, path: KeyPath) -> None:
        """Drop the origins of keys under `path` (its value was replaced as a whole)."""
        for key in [k for k in self.origin if len(k) > len(path) and k[: len(path)] == path]:
            del self.origin[key]


@dataclass
class LoadedRecipe:
    recipe: Recipe
    sources: Sources
    path: Path | None

    @property
    def name(self) -> str:
        if self.recipe.name:
            return self.recipe.name
        return self.path.stem if self.path else "recipe"

    @property
    def output_dir(self) -> Path:
        return Path(self.recipe.train.output_dir.format(name=self.name))
