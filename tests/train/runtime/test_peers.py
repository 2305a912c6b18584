"""A peer that died without a word: the lines that name it, and the roll call on a real TCPStore that finds it."""

from __future__ import annotations

import signal
from datetime import timedelta

import torch.distributed as dist

from memtrain.train.runtime.distributed import free_port
from memtrain.train.runtime.peers import (
    RESUME_HINT,
    answer_roll_call,
    describe_ranks,
    killed_line,
    lost_line,
    roll_call,
)


def test_ranks_are_named_with_their_nodes_as_torchrun_numbers_them():
    assert describe_ranks([3], local_world_size=2) == "rank 3 (node 1)"
    assert describe_ranks([2, 3], local_world_size=2) == "ranks 2, 3 (node 1)"
    assert describe_ranks([1, 2], local_world_size=2) == "ranks 1 (node 0), 2 (node 1)"


def test_the_lines_say_who_died_how_and_that_the_same_command_resumes():
    line = killed_line(1, local_world_size=2, signum=int(signal.SIGKILL), pid=4242)
    assert line.startswith("rank 1 (node 0), pid 4242 was killed by SIGKILL (the kernel's out-of-memory killer")
    assert RESUME_HINT in line
    assert lost_line([2, 3], local_world_size=2, world_size=4).startswith("ranks 2, 3 (node 1) ended without a word")
    gone = lost_line(None, local_world_size=2, world_size=4)
    assert gone.startswith("node 0 (ranks 0, 1 (node 0), which hosts the rendezvous) is gone") and RESUME_HINT in gone


def test_the_roll_call_names_the_ranks_that_do_not_answer_and_none_when_the_store_is_gone(monkeypatch):
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    assert roll_call(0, world_size=3, wait_s=0.3) == [1, 2]  # rank 0 answered for itself
    assert answer_roll_call(2) is not None
    assert roll_call(0, world_size=3, wait_s=0.3) == [1]
    del store  # node 0's torchrun agent, which hosts it, is gone
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert roll_call(1, world_size=3, wait_s=0.3) is None
