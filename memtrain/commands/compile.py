"""`memtrain compile`: the DeepSpeed config a recipe runs with, on stdout or into a file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console

from memtrain.checks.load import load_checked
from memtrain.ds_config.compiler import ds_config
from memtrain.files import write_atomically
from memtrain.train.resolve import resolve_micro_batch_of
from memtrain.train.runtime.allocator import exact_pinned_supported


def compile_command(recipe: Path, overrides: list[str], output: Path | None, console: Console) -> int:
    """Write the config at the recipe's starting micro-batch ('auto' resolved by the planner)."""
    loaded = load_checked(recipe, overrides)
    with loaded.sources.located():
        micro_batch = resolve_micro_batch_of(loaded.recipe, exact_pinned_supported())
    text = json.dumps(ds_config(loaded.recipe, micro_batch), indent=2) + "\n"
    if output is None:
        sys.stdout.write(text)
        return 0
    write_atomically(output, text)
    console.print(f"[green]✓[/] wrote {output}")
    return 0
