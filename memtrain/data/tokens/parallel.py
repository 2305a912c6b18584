"""Encoding batches of records in several processes at once.

A chat template renders in Python, one conversation at a time, so tokenising chat or instruction data used one core
(measured: 1.3-2.4 MB/s, about 100 % CPU, on a machine with more). `map_batches` hands the batches to forked worker
processes, one per core up to MAX_WORKERS, and yields their results in order, so the samples, their order and the
problems found are those of one process, reading the batches only a few ahead of the one it yields, so a stream of
records is never all in memory. The workers inherit what encodes (the tokenizer and the template) from the
fork, so only the batches and their results cross between processes; they ignore Ctrl-C, which the command handles
(the pool is ended with it), and end quietly on SIGTERM, which they also get when the command dies (_start_worker).
Few batches, one core, or no fork (Windows) mean this process does the work.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

Batch = TypeVar("Batch")
Result = TypeVar("Result")

PR_SET_PDEATHSIG = 1  # linux/prctl.h
MAX_WORKERS = 16
MIN_BATCHES = 8  # with fewer, starting the workers costs more than they save
LOOKAHEAD = 4  # batches handed to the pool per worker before the first of them is waited for
_work: Callable | None = None  # what the forked workers call: set before the fork


def worker_count(batches: int) -> int:
    """Processes to encode `batches` batches with: 1 (this one) when parallel work does not pay or cannot fork."""
    if batches < MIN_BATCHES or "fork" not in multiprocessing.get_all_start_methods():
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, MAX_WORKERS, batches))


def map_batches(
    work: Callable[[Batch], Result], batches: Iterable[Batch], count: int
) -> Iterator[tuple[Batch, Result]]:
    """(batch, work(batch)) for each of the `count` batches, in order, in forked workers when worker_count says so.
    `batches` is read as the workers take them, at most LOOKAHEAD per worker ahead of the one yielded, so a
    stream of batches is never all in memory."""
    global _work
    workers = worker_count(count)
    if workers == 1:
        yield from ((batch, work(batch)) for batch in batches)
        return
    _work = work
    # The tokenizers library warns in every forked child once its threads have run, unless the setting is explicit.
    parallelism = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        pool = multiprocessing.get_context("fork").Pool(workers, initializer=_start_worker, initargs=(os.getpid(),))
    finally:
        _restore("TOKENIZERS_PARALLELISM", parallelism)
    pending: deque = deque()  # (batch, its AsyncResult), in order
    try:
        for batch in batches:
            pending.append((batch, pool.apply_async(_call, (batch,))))
            if len(pending) >= LOOKAHEAD * workers:
                batch, result = pending.popleft()
                yield batch, result.get()
        while pending:
            batch, result = pending.popleft()
            yield batch, result.get()
        pool.close()
    finally:
        pool.terminate()
        pool.join()
        _work = None


def _call(batch):
    return _work(batch)


def _start_worker(parent: int) -> None:
    """Ctrl-C is the command's to handle; SIGTERM ends a worker quietly: the pool's end sends it, and so does Linux
    when the parent dies (a command killed, or one whose SIGTERM handler did not run), so no worker is left
    writing a BrokenPipeError traceback under the shell's prompt. A command's own SIGTERM handler is not inherited."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with contextlib.suppress(OSError, AttributeError):  # prctl is Linux's; elsewhere the pool's end still ends it
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
