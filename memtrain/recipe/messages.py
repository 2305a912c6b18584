"""pydantic validation errors rewritten for people: short phrases, the value given, what to do.

"Input should be greater than or equal to 1" becomes "must be at least 1, got 0"; unknown keys get a
did-you-mean from the keys the section knows; a union such as `int | 'auto'` reads as one sentence.
"""
from __future__ import annotations

import difflib
from typing import Any, get_args, get_origin

from pydantic import BaseModel, ValidationError

from memtrain.errors import Problem
from memtrain.recipe.schema import Recipe

KeyPath = tuple[str, ...]


def _section_class(annotation: Any) -> type[BaseModel] | None:
    candidates = [annotation, *get_args(annotation)]
    return next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)


def _model_at(path: KeyPath) -> type[BaseModel] | None:
    """The pydantic section class at a key path, for did-you-mean suggestions."""
    model: type[BaseModel] | None = Recipe
    for part in path:
        if model is None or part not in model.model_fields:
            return None
        model = _section_class(model.model_fields[part].annotation)
    return model


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
        nested = _section_class(annotation)
        current = nested or ("dict" if dict in (get_origin(annotation), *map(get_origin, get_args(annotation))) else "leaf")
    return tuple(path)


def _number(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


# pydantic's error type -> a short phrase that reads after the key ("batch.micro_batch: must be at least 1")
_PHRASES = {
    "greater_than_equal": lambda c: f"must be at least {_number(c['ge'])}",
    "greater_than": lambda c: f"must be greater than {_number(c['gt'])}",
    "less_than_equal": lambda c: f"must be at most {_number(c['le'])}",
    "less_than": lambda c: f"must be less than {_number(c['lt'])}",
    "int_type": lambda c: "must be a whole number",
    "int_parsing": lambda c: "must be a whole number",
    "int_from_float": lambda c: "must be a whole number",
    "float_type": lambda c: "must be a number",
    "float_parsing": lambda c: "must be a number",
    "finite_number": lambda c: "must be a finite number",
    "bool_type": lambda c: "must be true or false",
    "bool_parsing": lambda c: "must be true or false",
    "string_type": lambda c: "must be text",
    "literal_error": lambda c: f"must be {'one of ' if ',' in c['expected'] or ' or ' in c['expected'] else ''}"
                               f"{c['expected']}",
    "model_type": lambda c: "must be a section of keys",
    "model_attributes_type": lambda c: "must be a section of keys",
    "dict_type": lambda c: "must be a mapping of keys to values",
    "list_type": lambda c: "must be a list",
    "tuple_type": lambda c: "must be a list",
    "too_short": lambda c: f"needs at least {c['min_length']} item{'s' if c['min_length'] != 1 else ''}",
    "too_long": lambda c: f"has too many items (at most {c['max_length']})",
    "string_too_short": lambda c: "must not be empty",
}


def _shown(value: Any) -> str:
    if isinstance(value, (dict, list, tuple)):
        return "a mapping" if isinstance(value, dict) else "a list"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _explain(error: dict, path: KeyPath) -> tuple[str, str, bool]:
    """(phrase, hint, whether to show the input) for one pydantic error."""
    kind = error["type"]
    if kind == "extra_forbidden":
        key = path[-1] if path else ""
        section = _model_at(path[:-1])
        options = list(section.model_fields) if section else []
        close = difflib.get_close_matches(key, options, n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'?" if close else (f"known keys here: {', '.join(options)}" if options else "")
        return "unknown key", hint, False
    if kind == "missing":
        return "required key is missing", f"add '{path[-1]}' to the recipe" if path else "", False
    if kind in ("model_type", "model_attributes_type") and error.get("input") is None:
        return "is an empty section", "give its keys, or remove the line to use the defaults", False
    if kind in _PHRASES:
        return _PHRASES[kind](error.get("ctx") or {}), "", True
    message = error["msg"]
    if message.startswith("Value error, "):
        # our validators write "what is wrong — what to do"
        what, _, hint = message[len("Value error, "):].partition(" — ")
        return what, hint, False
    return message[:1].lower() + message[1:], "", True


def problems_from_validation(err: ValidationError, sources) -> list[Problem]:
    """One Problem per key path that pydantic rejected, in words people read; `sources` locates keys."""
    grouped: dict[KeyPath, list[tuple[str, str, bool, Any]]] = {}
    for error in err.errors():
        path = _clean_loc(error["loc"])
        grouped.setdefault(path, []).append((*_explain(error, path), error.get("input")))
    problems = []
    for path, explained in grouped.items():
        phrases = list(dict.fromkeys(phrase for phrase, _, _, _ in explained))
        if all(p.startswith("must be ") for p in phrases):
            # union fields: "must be a whole number or 'auto'" rather than two sentences
            message = "must be " + " or ".join(p[len("must be "):] for p in phrases)
        else:
            message = "; or ".join(phrases)
        show = [value for _, _, shown, value in explained if shown]
        if show:
            message += f", got {_shown(show[0])}"
        hints = [hint for _, hint, _, _ in explained if hint]
        problems.append(sources.problem(path, message, hints[0] if hints else _field_help(path)))
    return problems


def _field_help(path: KeyPath) -> str:
    """The description of the field at (or above, for list items) `path`, to say what the key is for."""
    for end in range(len(path), 0, -1):
        section = _model_at(path[: end - 1])
        if section is not None and path[end - 1] in section.model_fields:
            description = section.model_fields[path[end - 1]].description or ""
            return f"{description.rstrip('.')} (see docs/RECIPES.md)" if description else "see docs/RECIPES.md"
    return "see docs/RECIPES.md"
