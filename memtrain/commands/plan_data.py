"""Whether `memtrain plan` reads the data, and what it says when it could not.

Asked (--data), the data is read whatever its size, and a problem in it is the command's (exit 2). Not asked, the
plan reads it where all of it lies on this machine and weighs less than READ_DATA_BELOW_BYTES (a Hub dataset may need
a download, a large file minutes of tokenising), and a problem there (a record, a tokenizer not on this machine)
leaves the plan to the planner's assumed sample lengths, said in one line: a plan is what one runs before anything
else is ready. --no-data never reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

from memtrain.data.read.local_size import local_data_bytes
from memtrain.errors import UserError
from memtrain.recipe.schema import Recipe

# The bundled sets and a few thousand conversations: a few seconds the first time, then cached. Their lengths matter
# for long packed rows: the bundled chats at 32,768 tokens plan 8 % under the run with assumed lengths, 1.7 % over
# counted.
READ_DATA_BELOW_BYTES = 16 << 20

T = TypeVar("T")


def reads_data(recipe: Recipe, asked: bool | None) -> bool:
    """--data (True), --no-data (False), or neither (None): small data on this machine is read."""
    if asked is not None:
        return asked
    size = local_data_bytes(recipe.data)
    return size is not None and size < READ_DATA_BELOW_BYTES


def read_data(read: Callable[[], T], asked: bool | None) -> tuple[T | None, str | None]:
    """(what `read` returns, None), or where the read was not asked and failed, (None, the problem's first line)."""
    try:
        return read(), None
    except UserError as error:
        if asked:
            raise
        first = dataclasses.replace(error.problems[0], hint="") if error.problems else None
        return None, first.format() if first else str(error)


def unread_note(problem: str) -> str:
    return (
        f"[yellow]![/] the data was not read ({problem}), so the plan assumes its sample lengths; "
        "`memtrain validate --data` says every problem and what to do"
    )
