"""How far the data's first tokenisation has got, for a command to show: the data layer reports, a command listens.

Tokenising 1 GB of chat data takes minutes (1.3-2.4 MB/s on one core, measured), deep below the command that asked
for it, so the reports go to whoever listens in this process (`listening`), not through every builder between.
Nothing is reported when the data comes from the token cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

Listener = Callable[[str, int, int], None]  # (what is being tokenised, done, total)
_listeners: list[Listener] = []


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)


def report(what: str, done: int, total: int) -> None:
    for listener in _listeners:
        listener(what, done, total)
