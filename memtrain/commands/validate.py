"""`memtrain validate --data`: the recipe's data read and tokenised as a run reads it, so a bad record is found
before the run (file:line, the field, exit 2), as `run`, `prepare` and `preview` find it. The tokens go to the
token cache, so the run that follows starts from it."""

from __future__ import annotations

from rich.console import Console

from memtrain.recipe.sources import LoadedRecipe
from memtrain.train.progress_bar import tokenising_progress
from memtrain.train.setup import build_data


def validate_data(loaded: LoadedRecipe, console: Console) -> str:
    """Build the recipe's training and validation data (raises DataError naming the bad records, with the recipe's
    file:line); print its warnings to `console`; return what the training data became, for people."""
    with tokenising_progress(), loaded.sources.located():  # a bar per file it tokenises
        data = build_data(loaded.recipe)
    for warning in data.warnings:
        console.print(f"[yellow]![/] {warning}", highlight=False, soft_wrap=True)
    return data.train_set.stats.describe()
