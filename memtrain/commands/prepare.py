"""`memtrain prepare`: a run's one-time work, done ahead of it and without GPU time.

Two things make a run's first start slow, and neither needs the GPU: tokenising the data (into the token
cache, data/tokens/cache.py and data/tokens/tokenized.py) and building DeepSpeed's C++ ops (train/ops/deepspeed_ops.py).
`prepare` does both for a recipe, on the machine that will train (while its GPU is busy, or in a container's
set-up), and a run of the recipe then starts from the caches. The ops are built for this machine: without a
GPU, DeepSpeed's CPU builds, which a run on a GPU does not load. It checks the recipe as
`run` does (exit 2 on a problem) and writes nothing but the caches.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from memtrain.checks.load import load_checked
from memtrain.data.tokens.cache import cache_dir_of
from memtrain.recipe.sources import LoadedRecipe
from memtrain.train.ops.deepspeed_ops import Built, build, check_buildable, machine_has_gpu, ops_for
from memtrain.train.ops.locks import clear_stale_locks, extensions_root
from memtrain.train.progress_bar import tokenising_progress
from memtrain.train.setup import build_data


@dataclass(frozen=True)
class DataPrepared:
    cache_dir: Path
    new_entries: int  # datasets tokenised now (0: every one came from the cache)
    seconds: float
    described: str  # what the training data became, for people


def prepare_command(recipe: Path, overrides: list[str], as_json: bool, console: Console) -> int:
    loaded = load_checked(recipe, overrides)
    with _stdout_to_stderr() if as_json else contextlib.nullcontext():  # DeepSpeed logs and compilers print there
        data, built, on_gpu = _prepare(loaded, console)
    if as_json:
        sys.stdout.write(json.dumps(_summary(loaded.name, data, built, on_gpu), indent=2) + "\n")
    else:
        console.print(_table(loaded.name, data, built, on_gpu))
    return 0


def _prepare(loaded: LoadedRecipe, console: Console) -> tuple[DataPrepared, list[Built], bool]:
    r = loaded.recipe
    on_gpu = machine_has_gpu()
    with loaded.sources.located():
        check_buildable(r, on_gpu)  # before the tokenising: an op this machine cannot build is said first
    cache_dir = cache_dir_of(r.data.cache_dir)
    entries_before = _entries(cache_dir)
    started = time.perf_counter()
    with tokenising_progress(), loaded.sources.located():  # a bar per file it tokenises
        data = build_data(r)
    for warning in data.warnings:
        console.print(f"[yellow]![/] {warning}", highlight=False, soft_wrap=True)
    prepared = DataPrepared(
        cache_dir,
        len(_entries(cache_dir) - entries_before),
        time.perf_counter() - started,
        data.train_set.stats.describe(),
    )
    clear_stale_locks()
    built = []
    for op in ops_for(r, on_gpu):
        with console.status(f"DeepSpeed's {op.name} op, which {op.why} (a first build takes about half a minute)"):
            built.append(build(op))
    return prepared, built, on_gpu


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Everything written to stdout meanwhile, by Python or by a child process, goes to stderr: stdout keeps
    only the JSON."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _entries(cache_dir: Path) -> set[str]:
    """The complete entries of a token cache (the tokens file is written last)."""
    return {path.name for path in cache_dir.glob("*.tokens.npy")}


def _summary(name: str, data: DataPrepared, built: list[Built], on_gpu: bool) -> dict:
    return {
        "recipe": name,
        "machine": "gpu" if on_gpu else "cpu",
        "data": {
            "cache_dir": str(data.cache_dir),
            "tokenised_now": data.new_entries,
            "seconds": round(data.seconds, 2),
            "train": data.described,
        },
        "ops": [
            {"name": b.op.name, "used_for": b.op.why, "state": b.state, "seconds": round(b.seconds, 2)} for b in built
        ],
        "extensions_dir": str(extensions_root()),
    }


def _table(name: str, data: DataPrepared, built: list[Built], on_gpu: bool) -> Table:
    where = "a GPU" if on_gpu else "the CPU (this machine has no GPU; a GPU machine loads other builds of the ops)"
    table = Table(
        title=f"prepared {name} for a run on {where}",
        title_justify="left",
        caption_justify="left",
        caption=f"token cache: {data.cache_dir}; DeepSpeed's ops: {extensions_root()}",
    )
    for column in ("", "what for", "state"):
        table.add_column(column)
    table.add_column("s", justify="right")
    table.add_row(
        "data",
        data.described,
        f"tokenised now ({data.new_entries} new)" if data.new_entries else "from the cache",
        f"{data.seconds:.1f}",
    )
    for b in built:
        table.add_row(f"{b.op.name} op", b.op.why, b.state, f"{b.seconds:.1f}")
    if not built:
        table.add_row("ops", "none: a run of this recipe here loads none of DeepSpeed's C++ ops", "", "")
    return table
