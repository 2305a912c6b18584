"""Byte sizes as people write them ("24GiB", "16 GB", 1.5e9) and as code keeps them (int bytes)."""

from __future__ import annotations

import re

GiB = 1024**3
MiB = 1024**2

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1024,
    "mib": MiB,
    "gib": GiB,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(value: object) -> int:
    """Parse "24GiB", "24 GB", "512MiB" or a plain number of bytes into int bytes."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as '24GiB', got a boolean")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError("a size cannot be negative")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a size such as '24GiB', got {type(value).__name__}")
    match = _SIZE.match(value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"'{value}' is not a size; write it like '24GiB', '16GB' or '512MiB'")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def looks_like_size(value: str) -> bool:
    try:
        parse_bytes(value)
        return True
    except ValueError:
        return False


def gib(n_bytes: float) -> float:
    return n_bytes / GiB
