"""How many bytes of files on this machine a recipe's data reads: what `memtrain plan` weighs before it reads the
data without being asked (commands/plan.py). None where some of it is not here to weigh: a Hub dataset (reading it
may download it), a path that does not exist, or a builtin name that is none."""

from __future__ import annotations

from pathlib import Path

from memtrain.data.read.records import resolve_dataset_path
from memtrain.errors import DataError
from memtrain.hub import hub_repo
from memtrain.recipe.schema import Data


def local_data_bytes(data: Data) -> int | None:
    """The size of every file data.train and data.validation name (a directory's files summed), or None (above)."""
    total = 0
    for spec in _specs(data):
        if hub_repo(spec):
            return None
        try:
            path = resolve_dataset_path(spec)
        except DataError:
            return None
        size = _size(path)
        if size is None:
            return None
        total += size
    return total


def _specs(data: Data) -> list[str]:
    specs = []
    for source in (data.train, data.validation):
        if source is None:
            continue
        specs += [source] if isinstance(source, str) else [dataset.path for dataset in source]
    return specs


def _size(path: Path) -> int | None:
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(item.stat().st_size for item in path.rglob("*") if item.is_file())
    return None
