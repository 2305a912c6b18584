"""Read a recipe: YAML with line numbers, `extends:`, command-line overrides, validation.

Every problem that can be found is collected and raised together as one `RecipeError`: duplicate
keys, bad overrides, field errors (types, ranges, unknown keys) and the cross-field checks of the
sections that did validate. Only a file that cannot be parsed at all stops the reading early.
Nothing here prints.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import yaml
from pydantic import TypeAdapter, ValidationError

from memtrain.errors import Problem, RecipeError
from memtrain.hub import HUB_PREFIX, looks_like_repo_id
from memtrain.paths import kind_of
from memtrain.recipe.messages import problems_from_validation
from memtrain.recipe.rules import check_rules
from memtrain.recipe.schema import BUILTIN_PREFIX, Recipe
from memtrain.recipe.sources import COMMAND_LINE, KeyPath, LoadedRecipe, Sources

# ---------------------------------------------------------------- YAML with positions


def _yaml_syntax_problem(err: yaml.YAMLError, file: str) -> Problem:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    line = mark.line + 1 if mark else None
    what = getattr(err, "problem", None) or str(err).splitlines()[0]
    if "'\\t'" in what or "\t" in what:
        return Problem(
            "YAML syntax error: a tab character",
            file=file,
            line=line,
            hint="YAML indents with spaces; replace the tabs with spaces",
        )
    context = getattr(err, "context", None)
    if context:
        what = f"{what} ({context})"
    return Problem(
        f"YAML syntax error: {what}", file=file, line=line, hint="fix the indentation, colons or quoting at that line"
    )


# A recipe names a value once or twice more with an alias (`lr: &lr 3e-4` ... `*lr`); more than this is not a
# recipe but an alias bomb (nine levels of nine aliases expand to 387 million values: 9 GB and minutes).
MAX_ALIASES = 64
MAX_EXPANDED_NODES = 20_000  # values in the recipe with every alias expanded (a big recipe has a few hundred)


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses an alias inside its own anchor (a cycle), more than MAX_ALIASES aliases, and
    documents whose aliases expand to more than MAX_EXPANDED_NODES values, before anything is expanded."""

    def __init__(self, stream):
        super().__init__(stream)
        self.aliases_seen = 0
        self.open_anchors: set[str] = set()

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            self.aliases_seen += 1
            if event.anchor in self.open_anchors:
                raise _AliasProblem(
                    "an alias refers to the value that contains it (*{} inside &{})".format(event.anchor, event.anchor),
                    event.start_mark,
                )
            if self.aliases_seen > MAX_ALIASES:
                raise _AliasProblem(f"more than {MAX_ALIASES} YAML aliases", event.start_mark)
            return super().compose_node(parent, index)
        event = self.peek_event()
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            self.open_anchors.add(anchor)
        try:
            return super().compose_node(parent, index)
        finally:
            self.open_anchors.discard(anchor)


class _AliasProblem(Exception):
    def __init__(self, message: str, mark):
        super().__init__(message)
        self.message, self.line = message, mark.line + 1 if mark else None


def _expanded_size(node, sizes: dict[int, int]) -> int:
    """Values in `node` with every alias expanded, counted once per distinct node (no expansion happens)."""
    if id(node) in sizes:
        return sizes[id(node)]
    sizes[id(node)] = 1  # a cycle would count as 1; cycles are refused while composing
    children = (
        [n for pair in node.value for n in pair]
        if isinstance(node, yaml.MappingNode)
        else node.value
        if isinstance(node, yaml.SequenceNode)
        else []
    )
    size = 1 + sum(_expanded_size(child, sizes) for child in children)
    sizes[id(node)] = size
    return size


def _parse_yaml(text: str, file: str) -> tuple[dict, Sources, list[Problem]]:
    """The mapping in `text`, where each key is, and the non-fatal problems (duplicate keys)."""
    try:
        loader = _BoundedLoader(text)
        try:
            node = loader.get_single_node()
            if node is not None and _expanded_size(node, {}) > MAX_EXPANDED_NODES:
                raise _AliasProblem(
                    f"the YAML's aliases expand to more than {MAX_EXPANDED_NODES:,} values", node.start_mark
                )
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except _AliasProblem as err:
        raise RecipeError(
            Problem(
                f"{err.message}: not a recipe",
                file=file,
                line=err.line,
                hint="write the values out, or use a few aliases for repeated values",
            )
        ) from None
    except yaml.YAMLError as err:
        raise RecipeError(_yaml_syntax_problem(err, file)) from None
    except RecursionError:
        raise RecipeError(
            Problem(
                "the YAML is nested too deeply to be a recipe",
                file=file,
                hint="a recipe has at most three levels of sections",
            )
        ) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(
            Problem(
                "a recipe must be a mapping of sections (model:, data:, ...)",
                file=file,
                line=1,
                hint="start each section at the beginning of a line, e.g. 'model:'",
            )
        )
    sources = Sources(recipe_file=file)
    problems: list[Problem] = []
    _record_positions(node, (), file, sources, problems)
    return data, sources, problems


def _record_positions(node, path: KeyPath, file: str, sources: Sources, problems: list[Problem]) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value)
            line = key_node.start_mark.line + 1
            if key in seen:
                problems.append(
                    Problem(
                        f"key '{key}' appears twice in this section",
                        key=".".join(path + (key,)),
                        file=file,
                        line=line,
                        hint="keep one of them (the last one wins in YAML)",
                    )
                )
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


def _merge_sources(base: Sources, top: Sources, top_data: dict) -> Sources:
    """Origins of base and top; where top replaces a value whole, the base's keys under it go."""
    merged = Sources(origin=dict(base.origin), recipe_file=top.recipe_file)

    def replaced(data: dict, path: KeyPath) -> None:
        for key, value in data.items():
            if isinstance(value, dict):
                replaced(value, path + (str(key),))
            else:
                merged.forget_below(path + (str(key),))

    replaced(top_data, ())
    merged.origin.update(top.origin)
    return merged


def _read_with_extends(path: Path, chain: tuple[Path, ...] = ()) -> tuple[dict, Sources, list[Problem]]:
    file = str(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise RecipeError(Problem(f"cannot read recipe '{path}': {err.strerror}", file=file)) from None
    except UnicodeDecodeError:
        raise RecipeError(Problem(f"'{path}' is not UTF-8 text", file=file, hint="save the recipe as UTF-8")) from None
    data, sources, problems = _parse_yaml(text, file)
    parent = data.pop("extends", None)
    if parent is None:
        return data, sources, problems
    if not isinstance(parent, str) or not parent:
        problems.append(
            sources.problem(("extends",), "must be the path of another recipe file", "for example extends: base.yaml")
        )
        return data, sources, problems
    base_path = Path(parent) if Path(parent).is_absolute() else path.parent / parent
    if (kind := kind_of(base_path)) is not None:  # a directory, a FIFO (its read would wait for a writer forever)
        problems.append(
            sources.problem(
                ("extends",),
                f"extended recipe '{base_path}' is {kind}, not a recipe file",
                "name a .yaml recipe file; paths in extends are relative to the recipe that names them",
            )
        )
        return data, sources, problems
    if not base_path.is_file():
        problems.append(
            sources.problem(
                ("extends",),
                f"extended recipe '{base_path}' does not exist",
                "paths in extends are relative to the recipe that names them",
            )
        )
        return data, sources, problems
    chain = chain + (path.resolve(),)
    if base_path.resolve() in chain:
        cycle = " -> ".join(p.name for p in chain + (base_path.resolve(),))
        problems.append(
            sources.problem(
                ("extends",), f"recipes extend each other in a cycle: {cycle}", "remove 'extends' from one of them"
            )
        )
        return data, sources, problems
    base_data, base_sources, base_problems = _read_with_extends(base_path, chain)
    return _deep_merge(base_data, data), _merge_sources(base_sources, sources, data), base_problems + problems


# ---------------------------------------------------------------- relative paths


def input_paths(data: dict) -> Iterator[tuple[dict, str, KeyPath]]:
    """(holder, key, key path) of every value in the recipe's data that names an input file or directory:
    model.path, model.tokenizer, data.train and data.validation (a path, or each dataset's path). Outputs
    (train.output_dir, data.cache_dir, hardware.nvme_path) are not inputs: they stay where the run starts."""
    model = data.get("model")
    if isinstance(model, dict):
        for key in ("path", "tokenizer"):
            yield model, key, ("model", key)
    section = data.get("data")
    if not isinstance(section, dict):
        return
    for key in ("train", "validation"):
        value = section.get(key)
        if isinstance(value, str):
            yield section, key, ("data", key)
        elif isinstance(value, dict):  # one dataset written as a mapping
            yield value, "path", ("data", key, "path")
        elif isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, dict):
                    yield item, "path", ("data", key, str(index), "path")


def is_relative_path(value) -> bool:
    """A path spec that depends on the directory it is read from (not builtin:, hub:, absolute or ~)."""
    return (
        isinstance(value, str)
        and bool(value)
        and not value.startswith(BUILTIN_PREFIX)
        and not value.startswith(HUB_PREFIX)
        and not value.startswith("~")
        and not os.path.isabs(value)
    )


def resolve_input_paths(data: dict, sources: Sources) -> None:
    """Make every relative input path (see `input_paths`) absolute: against the directory of the recipe file
    that wrote it (the recipe, or a file it extends), as `extends:` is, and one given on the command line
    against the working directory, where it was typed. A recipe then runs the same from any directory, and the
    run's record names the files it read, wherever `eval` or `export` runs later (a path recorded as typed,
    relative, would not be found by `memtrain eval RUN_DIR` run from another directory)."""
    for holder, key, path in input_paths(data):
        file, _ = sources.where(path)
        if not is_relative_path(holder.get(key)):
            continue
        if path == ("model", "path") and _names_hub_model(holder[key], file):
            holder[key] = HUB_PREFIX + holder[key]
            continue
        if file == COMMAND_LINE:
            holder[key] = os.path.abspath(holder[key])
        elif Path(file).is_file():
            holder[key] = os.path.abspath(os.path.join(Path(file).parent, holder[key]))


def _names_hub_model(value: str, file: str | None) -> bool:
    """Whether a relative model.path is a Hub id: of the form org/name and no existing path from where it was
    written (the recipe file's directory; the working directory for the command line or recipe text)."""
    if not looks_like_repo_id(value):
        return False
    base = Path(file).parent if file and file != COMMAND_LINE and Path(file).is_file() else Path.cwd()
    return not (base / value).exists()


def absolute_input_paths(recipe: dict) -> dict:
    """A copy of a recipe as JSON with its relative input paths made absolute against the working directory: a
    run recorded before `resolve_input_paths` resolved command-line paths kept those as typed, relative to where
    it started (where it resumes), and compares with today's recipe this way."""
    recipe = copy.deepcopy(recipe)
    for holder, key, _ in input_paths(recipe):
        if is_relative_path(holder.get(key)):
            holder[key] = os.path.abspath(holder[key])
    return recipe


def apply_overrides(data: dict, overrides: list[str], sources: Sources) -> tuple[dict, list[Problem]]:
    """Apply `key.path=value` overrides (values parsed as YAML: 3, true, [a, b], 24GiB); a number in the path
    is a list's index (data.train.1.weight=2).

    Returns the data and one problem per override that could not be applied; the others apply.
    """
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        parts = key.split(".")
        if not sep or not key or not all(parts):
            problems.append(
                Problem(
                    f"override '{item}' is not of the form key.path=value",
                    file=COMMAND_LINE,
                    hint="for example batch.micro_batch=2",
                )
            )
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw  # not YAML: take it as the literal text the user typed
        problem = _set(data, key, value, sources)
        if problem is not None:
            problems.append(problem)
    return data, problems


def _set(data: dict, key: str, value: object, sources: Sources) -> Problem | None:
    """data[key path] = value, sections the path names made as needed; the problem when the path cannot be set."""
    parts = key.split(".")
    node = data
    for depth, part in enumerate(parts):
        prefix = ".".join(parts[:depth])
        if isinstance(node, list):  # a list's item by its index: data.train.0.path=...
            if not (part.isdigit() and int(part) < len(node)):
                return Problem(
                    f"cannot set '{key}': '{prefix}' is a list of {len(node)}, and '{part}' is not one of its indexes",
                    key=key,
                    file=COMMAND_LINE,
                    hint=f"use an index from 0 to {len(node) - 1}" if node else f"set {prefix}=[...] instead",
                )
            part = int(part)
        elif not isinstance(node, dict):
            return Problem(
                f"cannot set '{key}': '{prefix}' is a value, not a section",
                key=key,
                file=COMMAND_LINE,
                hint=f"set {prefix}=... instead",
            )
        if depth == len(parts) - 1:
            node[part] = value
            sources.forget_below(tuple(parts))
            sources.origin[tuple(parts)] = (COMMAND_LINE, None)
            if isinstance(node, dict):
                _drop_replaced_choice(node, tuple(parts), value, sources)
        elif isinstance(node, dict) and node.get(part) is None:
            node[part] = {}
            node = node[part]
            # a section the override brings into being is the command line's: an error about it
            # (nonexistent.key=1: 'nonexistent' is unknown) points there, not at the recipe file
            sources.origin.setdefault(tuple(parts[: depth + 1]), (COMMAND_LINE, None))
        else:
            node = node[part]
    return None


# Keys of which a recipe gives one: an override of one replaces the other where the recipe file set it
# (`run recipes/llama2-7b-lora-24gb.yaml model.path=/models/llama-2-7b` trains that directory, not the preset).
_ONE_OF = {("model", "path"): "preset", ("model", "preset"): "path"}


def _drop_replaced_choice(section: dict, key: tuple[str, ...], value: object, sources: Sources) -> None:
    other = _ONE_OF.get(key)
    if other is None or value is None or section.get(other) is None:
        return
    if sources.origin.get((*key[:-1], other), (None,))[0] == COMMAND_LINE:
        return  # both given on the command line: said as the conflict it is
    section[other] = None
    sources.forget_below((*key[:-1], other))


# ---------------------------------------------------------------- validation


def validate_sections(data: dict, sources: Sources) -> tuple[Recipe, list[Problem], set[str]]:
    """Validate what can be validated: (recipe, problems, names of sections that did not validate).

    When some sections fail, the recipe holds the good sections and defaults elsewhere (the failed
    required ones are absent), so that cross-field checks can still run on the sections that passed.
    """
    try:
        return Recipe.model_validate(data), [], set()
    except ValidationError as err:
        problems = problems_from_validation(err, sources)
        bad = {str(e["loc"][0]) for e in err.errors() if e["loc"]}
    values = {}
    for name, info in Recipe.model_fields.items():
        if name in bad:
            if not info.is_required():
                values[name] = info.get_default(call_default_factory=True)
        elif name in data:
            values[name] = TypeAdapter(info.annotation).validate_python(data[name])
        elif not info.is_required():
            values[name] = info.get_default(call_default_factory=True)
    return Recipe.model_construct(**values), problems, bad


def validate(data: dict, sources: Sources) -> Recipe:
    """The validated recipe; raises RecipeError with every field problem."""
    recipe, problems, _ = validate_sections(data, sources)
    if problems:
        raise RecipeError(problems)
    return recipe


# A further check handed in by a layer above (the files, models and packages a recipe names):
# (loaded recipe, sections that failed validation) -> problems, reported with the recipe's own.
MoreChecks = Callable[[LoadedRecipe, set[str]], list[Problem]]


def _finish(
    data: dict,
    sources: Sources,
    problems: list[Problem],
    path: Path | None,
    check: bool,
    more_checks: MoreChecks | None,
) -> LoadedRecipe:
    recipe, field_problems, bad_sections = validate_sections(data, sources)
    problems = problems + field_problems
    loaded = LoadedRecipe(recipe=recipe, sources=sources, path=path)
    if check:
        problems += check_rules(loaded, skip_sections=bad_sections)
    if more_checks is not None:
        problems += more_checks(loaded, bad_sections)
    if problems:
        raise RecipeError(sorted(problems, key=lambda p: _reading_order(p, sources.recipe_file)))
    return loaded


def _reading_order(problem: Problem, recipe_file: str) -> tuple:
    """The recipe's own lines first, top to bottom; then extended files; the command line last."""
    rank = 0 if problem.file == recipe_file else 2 if problem.file == COMMAND_LINE else 1
    return rank, problem.file, problem.line is None, problem.line or 0


def load_recipe(
    path: str | Path, overrides: list[str] | None = None, check: bool = True, more_checks: MoreChecks | None = None
) -> LoadedRecipe:
    """Read, merge (`extends:`), override, validate and cross-check a recipe file (`check`: the rules
    between its fields; `more_checks`: what a layer above adds, see memtrain.checks.load_checked).

    Raises RecipeError holding every problem found, each with file:line, key path and a hint.
    """
    path = Path(path)
    if not path.exists():
        raise RecipeError(Problem(f"recipe file '{path}' does not exist", hint="check the path"))
    if (kind := kind_of(path)) is not None:  # a directory, a FIFO (its read would wait for a writer forever)
        raise RecipeError(Problem(f"'{path}' is {kind}, not a recipe file", hint="give a .yaml file"))
    data, sources, problems = _read_with_extends(path)
    data, override_problems = apply_overrides(data, list(overrides or []), sources)
    resolve_input_paths(data, sources)
    return _finish(data, sources, problems + override_problems, path, check, more_checks)


def load_recipe_text(
    text: str,
    file: str = "<recipe>",
    overrides: list[str] | None = None,
    check: bool = True,
    more_checks: MoreChecks | None = None,
) -> LoadedRecipe:
    """Validate recipe text held in memory (tests, tools); like load_recipe without `extends:`."""
    data, sources, problems = _parse_yaml(text, file)
    if "extends" in data:
        problems.append(
            sources.problem(
                ("extends",), "extends needs a recipe file, not text", "save the recipe to a file and use load_recipe"
            )
        )
        del data["extends"]
    data, override_problems = apply_overrides(data, list(overrides or []), sources)
    return _finish(data, sources, problems + override_problems, None, check, more_checks)
