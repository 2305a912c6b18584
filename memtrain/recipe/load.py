"""Read a recipe: YAML with line numbers, `extends:`, command-line overrides, validation.

All problems are collected and raised together as one `RecipeError`; nothing here prints.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from memtrain.errors import Problem, RecipeError
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
        file, line = self.where(path)
        return Problem(message=message, key=".".join(path), file=file, line=line, hint=hint)


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


# ---------------------------------------------------------------- YAML with positions


def _parse_yaml(text: str, file: str) -> tuple[dict, Sources]:
    try:
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line = mark.line + 1 if mark else None
        what = err.problem or str(err)
        raise RecipeError(Problem(f"YAML syntax error: {what}", file=file, line=line,
                                  hint="fix the indentation or quoting at that line")) from None
    except yaml.YAMLError as err:
        raise RecipeError(Problem(f"YAML error: {err}", file=file)) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(Problem("a recipe must be a mapping of sections (model:, data:, ...)", file=file, line=1))
    sources = Sources(recipe_file=file)
    problems: list[Problem] = []
    _record_positions(node, (), file, sources, problems)
    if problems:
        raise RecipeError(problems)
    return data, sources


def _record_positions(node, path: KeyPath, file: str, sources: Sources, problems: list[Problem]) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value)
            line = key_node.start_mark.line + 1
            if key in seen:
                problems.append(Problem(f"key '{key}' appears twice", key=".".join(path + (key,)),
                                        file=file, line=line, hint="keep one of them"))
            seen.add(key)
            sources.origin[path + (key,)] = (file, line)
            _record_positions(value_node, path + (key,), file, sources, problems)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            sources.origin[path + (str(index),)] = (file, item.start_mark.line + 1)
            _record_positions(item, path + (str(index),), file, sources, problems)


# ---------------------------------------------------------------- extends and overrides


def _deep_merge(base: dict, top: dict) -> dict:
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _read_with_extends(path: Path, chain: tuple[Path, ...] = ()) -> tuple[dict, Sources]:
    file = str(path)
    if path.resolve() in chain:
        raise RecipeError(Problem("recipes extend each other in a cycle: "
                                  + " -> ".join(str(p) for p in chain + (path,)), key="extends", file=file))
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise RecipeError(Problem(f"recipe file '{path}' does not exist", file=str(chain[-1]) if chain else "",
                                  key="extends" if chain else "", hint="check the path")) from None
    except OSError as err:
        raise RecipeError(Problem(f"cannot read recipe: {err.strerror}", file=file)) from None
    data, sources = _parse_yaml(text, file)
    parent = data.pop("extends", None)
    if parent is None:
        return data, sources
    if not isinstance(parent, str):
        raise RecipeError(sources.problem(("extends",), "must be the path of another recipe file"))
    base_path = (path.parent / parent) if not Path(parent).is_absolute() else Path(parent)
    if not base_path.exists():
        raise RecipeError(sources.problem(("extends",), f"extended recipe '{base_path}' does not exist",
                                          hint="paths in extends are relative to the recipe that names them"))
    base_data, base_sources = _read_with_extends(base_path, chain + (path.resolve(),))
    merged_sources = Sources(origin={**base_sources.origin, **sources.origin}, recipe_file=file)
    return _deep_merge(base_data, data), merged_sources


def apply_overrides(data: dict, overrides: list[str], sources: Sources) -> dict:
    """Apply `key.path=value` overrides; values are parsed as YAML (3, true, [a, b], 24GiB)."""
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            problems.append(Problem(f"override '{item}' is not of the form key.path=value", file=COMMAND_LINE,
                                    hint="for example batch.micro_batch=2"))
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        parts = key.split(".")
        node = data
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                problems.append(Problem(f"cannot set '{key}': '{'.'.join(parts[:depth + 1])}' is not a section",
                                        key=key, file=COMMAND_LINE))
                break
            node = child
        else:
            node[parts[-1]] = value
            sources.origin[tuple(parts)] = (COMMAND_LINE, None)
    if problems:
        raise RecipeError(problems)
    return data


# ---------------------------------------------------------------- validation


def _model_at(path: KeyPath) -> type[BaseModel] | None:
    """The pydantic section class at a key path, for did-you-mean suggestions."""
    model: Any = Recipe
    for part in path:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        annotation = model.model_fields[part].annotation
        candidates = [annotation, *get_args(annotation)]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None and get_origin(annotation) is dict:
            return None
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _clean_loc(loc: tuple) -> KeyPath:
    """Drop the union-member tags pydantic appends below leaf fields ('int', "literal['auto']")."""
    path: list[str] = []
    current: Any = Recipe  # a section class, "dict", or "leaf"
    for part in loc:
        if isinstance(part, int):
            path.append(str(part))
            continue
        if current == "leaf":
            continue
        path.append(str(part))
        if current == "dict":
            current = "leaf"
            continue
        if part not in current.model_fields:
            current = "leaf"
            continue
        annotation = current.model_fields[part].annotation
        nested = [a for a in (annotation, *get_args(annotation)) if isinstance(a, type) and issubclass(a, BaseModel)]
        current = nested[0] if nested else ("dict" if get_origin(annotation) is dict else "leaf")
    return tuple(path)


def _explain(error: dict, path: KeyPath) -> tuple[str, str]:
    kind = error["type"]
    if kind == "extra_forbidden":
        key = path[-1] if path else ""
        section = _model_at(path[:-1])
        options = list(section.model_fields) if section else []
        close = difflib.get_close_matches(key, options, n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'?" if close else (f"known keys here: {', '.join(options)}" if options else "")
        return "unknown key", hint
    if kind == "missing":
        return "required key is missing", "add it to the recipe"
    message = error["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    return message, ""


def validate(data: dict, sources: Sources) -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        grouped: dict[KeyPath, list[tuple[str, str]]] = {}
        for error in err.errors():
            path = _clean_loc(error["loc"])
            grouped.setdefault(path, []).append(_explain(error, path))
        problems = []
        for path, explained in grouped.items():
            messages = list(dict.fromkeys(m for m, _ in explained))
            hints = [h for _, h in explained if h]
            problems.append(sources.problem(path, "; or ".join(messages), hints[0] if hints else ""))
        raise RecipeError(problems) from None


def load_recipe(path: str | Path, overrides: list[str] | None = None, check: bool = True) -> LoadedRecipe:
    """Read, merge, override, validate and cross-check a recipe file. Raises RecipeError."""
    from memtrain.recipe.checks import check_recipe  # checks need the loaded recipe's sources

    path = Path(path)
    if not path.exists():
        raise RecipeError(Problem(f"recipe file '{path}' does not exist", hint="check the path"))
    if path.is_dir():
        raise RecipeError(Problem(f"'{path}' is a directory, not a recipe file"))
    data, sources = _read_with_extends(path)
    data = apply_overrides(data, list(overrides or []), sources)
    recipe = validate(data, sources)
    loaded = LoadedRecipe(recipe=recipe, sources=sources, path=path)
    if check:
        problems = check_recipe(loaded)
        if problems:
            raise RecipeError(problems)
    return loaded


def load_recipe_text(text: str, file: str = "<recipe>", overrides: list[str] | None = None) -> LoadedRecipe:
    """Validate recipe text (used by tests and tools that hold YAML in memory)."""
    from memtrain.recipe.checks import check_recipe

    data, sources = _parse_yaml(text, file)
    if "extends" in data:
        raise RecipeError(sources.problem(("extends",), "extends needs a recipe file, not text"))
    data = apply_overrides(data, list(overrides or []), sources)
    loaded = LoadedRecipe(recipe=validate(data, sources), sources=sources, path=None)
    problems = check_recipe(loaded)
    if problems:
        raise RecipeError(problems)
    return loaded
