"""pydantic validation errors rewritten for people: short phrases, the value given, what to do.

"Input should be greater than or equal to 1" becomes "must be at least 1, got 0"; unknown keys get a
did-you-mean from the keys the section knows; a union such as `int | 'auto'` reads as one sentence.
"""

from __future__ import annotations

import difflib
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, Tag, ValidationError

from memtrain.errors import Problem
from memtrain.recipe.schema import Recipe

KeyPath = tuple[str, ...]


def _bare(annotation: Any) -> Any:
    """The annotation without Annotated[...] wrappers and without `| None`."""
    while True:
        if get_origin(annotation) is Annotated:
            annotation = get_args(annotation)[0]
            continue
        if get_origin(annotation) in (Union, UnionType):
            members = [a for a in get_args(annotation) if a is not type(None)]
            if len(members) == 1:
                annotation = members[0]
                continue
        return annotation


def _union_members(annotation: Any) -> list[Any]:
    """The members of a union of two or more types (None left out), or [] for anything else."""
    annotation = _bare(annotation)
    if get_origin(annotation) not in (Union, UnionType):
        return []
    return [a for a in get_args(annotation) if a is not type(None)]


def _tag_of(member: Any) -> str | None:
    """The Tag('...') of a discriminated union's member, if it has one."""
    if get_origin(member) is Annotated:
        return next((m.tag for m in member.__metadata__ if isinstance(m, Tag)), None)
    return None


def _child(annotation: Any, part: str) -> Any:
    """The annotation of `part` (a key, or a list position as digits) inside a value of `annotation`; None
    when there is none (a leaf, or a key the section does not have)."""
    members = _union_members(annotation)
    if members:  # `str | list[DatasetSpec]`, `list[str] | 'all-linear'`: the member that can hold `part`
        children = [_child(member, part) for member in members]
        return next((c for c in children if c is not None), None)
    annotation = _bare(annotation)
    origin, args = get_origin(annotation), get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        info = annotation.model_fields.get(part)
        return info.annotation if info is not None else None
    if origin is dict and args:
        return args[1]
    if origin in (list, set, frozenset) and args and part.isdigit():
        return args[0]
    if origin is tuple and args and part.isdigit():
        if len(args) == 2 and args[1] is Ellipsis:
            return args[0]
        return args[int(part)] if int(part) < len(args) else None
    return None


def _annotation_at(path: KeyPath) -> Any:
    """The annotation of the value at a key path (list positions as digits), or None when there is none."""
    annotation: Any = Recipe
    for part in path:
        if annotation is None:
            return None
        annotation = _child(annotation, part)
    return annotation


def _model_at(path: KeyPath) -> type[BaseModel] | None:
    """The pydantic section class at a key path (data.train.0 is a DatasetSpec), for did-you-mean suggestions."""
    annotation = _bare(_annotation_at(path))
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _union_member_named(annotation: Any, tag: str) -> Any:
    """The member of a union that pydantic names `tag` in an error's location: a discriminated union's Tag
    ('datasets'), or a smart union's label ('list[str]', 'int', "literal['auto']"). None: a leaf member."""
    members = _union_members(annotation)
    tagged = next((m for m in members if _tag_of(m) == tag), None)
    if tagged is not None:
        return tagged
    for member in members:
        bare = _bare(member)
        if isinstance(bare, type) and issubclass(bare, BaseModel) and bare.__name__ == tag:
            return bare
        origin = get_origin(bare)
        if origin is not None and isinstance(origin, type) and tag.startswith(f"{origin.__name__}["):
            return bare
    return None


def _clean_loc(loc: tuple) -> KeyPath:
    """pydantic's error location as the recipe's key path: the union-member tags pydantic puts in it
    ('datasets', 'list[str]', 'int', "literal['auto']") dropped, list positions kept as digits."""
    path: list[str] = []
    annotation: Any = Recipe  # the type of the value at `path`; None below a leaf or an unknown key
    for part in loc:
        if annotation is not None and isinstance(part, str) and _union_members(annotation):
            annotation = _union_member_named(annotation, part)  # a tag, not a key
            continue
        if annotation is None and not isinstance(part, int):
            continue  # pydantic's labels below a leaf, e.g. 'function-after[...]'
        path.append(str(part))
        annotation = _child(annotation, str(part)) if annotation is not None else None
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
    "literal_error": lambda c: (
        f"must be {'one of ' if ',' in c['expected'] or ' or ' in c['expected'] else ''}{c['expected']}"
    ),
    "model_type": lambda c: "must be a section of keys",
    "model_attributes_type": lambda c: "must be a section of keys",
    "dict_type": lambda c: "must be a mapping of keys to values",
    "list_type": lambda c: "must be a list",
    "tuple_type": lambda c: "must be a list",
    "too_short": lambda c: f"needs at least {c['min_length']} item{'s' if c['min_length'] != 1 else ''}",
    "too_long": lambda c: f"has too many items (at most {c['max_length']})",
    "string_too_short": lambda c: "must not be empty",
    "tuple_length": lambda c: f"must be a list of {c['length']} {c['items']}",
}


def _fixed_tuple(annotation: Any) -> tuple | None:
    """The member types of a fixed-length tuple (optimizer.betas: (float, float)), else None."""
    bare = _bare(annotation)
    args = get_args(bare)
    if get_origin(bare) is not tuple or not args or (len(args) == 2 and args[1] is Ellipsis):
        return None
    return args


def _as_tuple_length(error: dict, path: KeyPath) -> tuple[dict, KeyPath]:
    """A fixed-length tuple given too few or too many values, or not a list at all, is one error at the tuple's
    own key ("optimizer.betas: must be a list of 2 numbers, got [0.9]"), not 'optimizer.betas.1: required key is
    missing'."""
    kind = error["type"]
    if kind == "missing" and path and path[-1].isdigit() and _fixed_tuple(_annotation_at(path[:-1])):
        path = path[:-1]
    elif kind not in ("too_long", "too_short", "tuple_type", "list_type") or not _fixed_tuple(_annotation_at(path)):
        return error, path
    members = [_bare(a) for a in _fixed_tuple(_annotation_at(path))]
    items = (
        "numbers"
        if all(m in (int, float) for m in members) and float in members
        else "whole numbers"
        if all(m is int for m in members)
        else "texts"
        if all(m is str for m in members)
        else "values"
    )
    return {"type": "tuple_length", "ctx": {"length": len(members), "items": items}, "input": error.get("input")}, path


def _shown(value: Any) -> str:
    if isinstance(value, (list, tuple)) and not any(isinstance(v, (dict, list, tuple)) for v in value):
        text = "[" + ", ".join(_shown(v) for v in value) + "]"  # a short list of values reads as written
        return text if len(text) <= 40 else "a list"
    if isinstance(value, (dict, list, tuple)):
        return "a mapping" if isinstance(value, dict) else "a list"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# What users of HF TrainingArguments, Axolotl and LLaMA-Factory write, and memtrain's key for it, so that
# optimizer.learning_rate is answered with memtrain's name, not with the list of the section's keys.
FAMILIAR_KEYS = {
    "learning_rate": "optimizer.lr",
    "max_grad_norm": "optimizer.grad_clip",
    "lr_scheduler_type": "schedule.decay",
    "lr_scheduler": "schedule.decay",
    "warmup_steps": "schedule.warmup_steps",
    "max_steps": "train.steps",
    "num_train_epochs": "train.epochs",
    "num_epochs": "train.epochs",
    "save_steps": "train.save_every",
    "eval_steps": "train.eval_every",
    "logging_steps": "train.log_every",
    "seed": "train.seed",
    "output_dir": "train.output_dir",
    "per_device_train_batch_size": "batch.micro_batch",
    "micro_batch_size": "batch.micro_batch",
    "gradient_accumulation_steps": "batch.global_batch (global batch = micro-batch × accumulation × GPUs)",
    "max_seq_length": "data.seq_len",
    "sequence_len": "data.seq_len",
    "cutoff_len": "data.seq_len",
    "max_length": "data.seq_len",
    "datasets": "data.train",
    "dataset": "data.train",
    "base_model": "model.path",
    "model_name_or_path": "model.path",
    "lora_r": "model.lora.r",
    "lora_rank": "model.lora.r",
    "lora_alpha": "model.lora.alpha",
    "lora_dropout": "model.lora.dropout",
    "lora_target_modules": "model.lora.target_modules",
    "lora_target": "model.lora.target_modules",
    "gradient_checkpointing": "checkpointing.strategy",
    "bf16": "precision.compute",
    "fp16": "precision.compute",
}


def _explain(error: dict, path: KeyPath, written: KeyPath) -> tuple[str, str, bool]:
    """(phrase, hint, whether to show the input) for one pydantic error at `path` (as validated: list positions
    included), which the recipe wrote as `written`."""
    kind = error["type"]
    if kind == "extra_forbidden":
        key = path[-1] if path else ""
        section = _model_at(path[:-1])
        options = list(section.model_fields) if section else []
        close = difflib.get_close_matches(key, options, n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'?" if close else (f"known keys here: {', '.join(options)}" if options else "")
        if key in FAMILIAR_KEYS:  # another tool's name for it: say memtrain's, wherever it was written
            hint = f"memtrain's key for it is {FAMILIAR_KEYS[key]}"
        return "unknown key", hint, False
    if kind == "missing":
        if not path:
            return "required key is missing", "", False
        owner = ".".join(written[:-1]) or "the recipe"
        return "required key is missing", f"add '{path[-1]}' to {owner}: {_field_help(path)}", False
    if kind in ("model_type", "model_attributes_type") and error.get("input") is None:
        return "is an empty section", "give its keys, or remove the line to use the defaults", False
    if kind in _PHRASES:
        return _PHRASES[kind](error.get("ctx") or {}), "", True
    message = error["msg"]
    if message.startswith("Value error, "):
        # our validators write "what is wrong — what to do"
        what, _, hint = message[len("Value error, ") :].partition(" — ")
        return what, hint, False
    return message[:1].lower() + message[1:], "", True


def problems_from_validation(err: ValidationError, sources) -> list[Problem]:
    """One Problem per key path that pydantic rejected, in words people read; `sources` locates keys."""
    grouped: dict[KeyPath, list[tuple[str, str, bool, Any]]] = {}
    for error in err.errors():
        error, path = _as_tuple_length(error, _clean_loc(error["loc"]))
        grouped.setdefault(path, []).append((*_explain(error, path, _as_written(path, sources)), error.get("input")))
    problems = []
    for path, explained in grouped.items():
        phrases = list(dict.fromkeys(phrase for phrase, _, _, _ in explained))
        if all(p.startswith("must be ") for p in phrases):
            # union fields: "must be a whole number or 'auto'" rather than two sentences
            message = "must be " + " or ".join(p[len("must be ") :] for p in phrases)
        else:
            message = "; or ".join(phrases)
        show = [value for _, _, shown, value in explained if shown]
        if show:
            message += f", got {_shown(show[0])}"
        hints = [hint for _, hint, _, _ in explained if hint]
        problems.append(sources.problem(_as_written(path, sources), message, hints[0] if hints else _field_help(path)))
    return problems


def _as_written(path: KeyPath, sources) -> KeyPath:
    """The key path as the recipe wrote it: a dataset written as a mapping (`train: {path: ..., type: chat}`)
    is validated as a list of one, but its keys are data.train.type, not data.train.0.type."""
    for index, part in enumerate(path):
        if part != "0" or path[: index + 1] in sources.origin:
            continue
        above = path[:index]
        if any(len(key) == index + 1 and key[:index] == above and not key[index].isdigit() for key in sources.origin):
            return path[:index] + path[index + 1 :]
    return path


def _field_help(path: KeyPath) -> str:
    """The description of the field at (or above, for list items) `path`, to say what the key is for."""
    for end in range(len(path), 0, -1):
        section = _model_at(path[: end - 1])
        if section is not None and path[end - 1] in section.model_fields:
            description = section.model_fields[path[end - 1]].description or ""
            return f"{description.rstrip('.')} (see docs/RECIPES.md)" if description else "see docs/RECIPES.md"
    return "see docs/RECIPES.md"
