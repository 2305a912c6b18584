"""A peer process that died without a word (SIGKILL, the kernel's out-of-memory killer, a lost machine): which rank
and node it was, said in one line, with an exit code that says it.

A collective whose peer is gone breaks at once on every survivor ("Connection reset by peer"); nothing in that error
says which rank left. Two places know more:
- the torchrun agent of the node the process ran on sees it end by a signal (`killed_line`, said by
  memtrain.train.runtime.signals);
- the survivors on other nodes answer a roll call on the store that node 0's torchrun agent hosts (`roll_call`): the
  ranks that never answer are gone; a store that cannot be reached means node 0 itself is gone.
Every survivor ends with EXIT_PEER_LOST; nothing is saved after the last complete checkpoint, so running the same
command(s) again resumes from it.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

ROLL_CALL_PREFIX = "memtrain-alive/"
ROLL_CALL_S = 2.0  # survivors reach the roll call within milliseconds of each other (their sockets reset together)
STORE_TIMEOUT_S = 3.0
RESUME_HINT = "run the same command on every node again to resume from the last complete checkpoint"


def node_of(rank: int, local_world_size: int) -> int:
    """torchrun's static rendezvous numbers ranks node by node: node k holds ranks k*L .. k*L + L - 1."""
    return rank // max(1, local_world_size)


def describe_ranks(ranks: list[int], local_world_size: int) -> str:
    """'rank 3 (node 1)', 'ranks 2, 3 (node 1)', 'ranks 1 (node 0), 2 (node 1)'."""
    nodes = {node_of(rank, local_world_size) for rank in ranks}
    word = "rank" if len(ranks) == 1 else "ranks"
    if len(nodes) == 1:
        return f"{word} {', '.join(map(str, ranks))} (node {nodes.pop()})"
    return f"{word} " + ", ".join(f"{rank} (node {node_of(rank, local_world_size)})" for rank in ranks)


def lost_line(missing: list[int] | None, local_world_size: int, world_size: int) -> str:
    """The survivor's line: which ranks left without a word (None: the store on node 0 is gone too)."""
    if missing is None:
        first = describe_ranks(list(range(min(local_world_size, world_size))), local_world_size)
        who = f"node 0 ({first}, which hosts the rendezvous) is gone"
    elif missing:
        who = f"{describe_ranks(missing, local_world_size)} ended without a word"
    else:
        who = "a process of the run ended without a word"
    return (
        f"{who} (killed, e.g. by SIGKILL or the kernel's out-of-memory killer, or its machine was lost); the run "
        f"stopped on every node — {RESUME_HINT}"
    )


def killed_line(rank: int, local_world_size: int, signum: int, pid: int | None) -> str:
    """The line of the torchrun agent whose worker ended by a signal."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    process = f", pid {pid}" if pid else ""
    why = " (the kernel's out-of-memory killer sends it too: `dmesg` says)" if signum == signal.SIGKILL else ""
    return (
        f"{describe_ranks([rank], local_world_size)}{process} was killed by {name}{why}; the run stopped on every "
        f"node — {RESUME_HINT}"
    )


def _store():
    """A client of the store that torchrun's agent on node 0 hosts (MASTER_ADDR:MASTER_PORT of every worker)."""
    import torch.distributed as dist  # noqa: PLC0415 — as the collectives in distributed.py do

    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=STORE_TIMEOUT_S),
        wait_for_workers=False,
    )


def answer_roll_call(rank: int):
    """Say on the store that this rank is alive; returns the store client, or None when it cannot be reached."""
    try:
        store = _store()
        store.set(f"{ROLL_CALL_PREFIX}{rank}", "1")
    except Exception:  # noqa: BLE001 — any failure to reach it means the same: node 0's agent is gone
        return None
    return store


def roll_call(rank: int, world_size: int, wait_s: float = ROLL_CALL_S) -> list[int] | None:
    """The ranks that did not answer within `wait_s` (answering for this one), or None when the store is gone."""
    store = answer_roll_call(rank)
    if store is None:
        return None
    keys = [f"{ROLL_CALL_PREFIX}{other}" for other in range(world_size)]
    deadline = time.monotonic() + wait_s
    missing: list[int] = list(range(world_size))
    while True:
        try:
            missing = [other for other, key in enumerate(keys) if not store.check([key])]
        except Exception:  # noqa: BLE001 — node 0's agent left after its workers: the last answers stand
            break
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    return missing
