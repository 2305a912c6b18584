"""The schema's sections as the recipe tests walk them: a field's own section class, if it holds one directly
(`Section` or `Section | None`; a section inside a list or a union of several, as data.train's DatasetSpec, is
not followed)."""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel


def section_class(annotation: Any) -> type[BaseModel] | None:
    candidates = [annotation, *get_args(annotation)]
    return next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
