"""Two "nodes" on localhost: two `memtrain run … --nnodes 2 --node-rank 0|1` launchers, one process each,
joined by torchrun's rendezvous over gloo, train the quickstart recipe (shrunk) as one process would."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memtrain.train.runtime.distributed import free_port
from memtrain.train.state.checkpoint import complete_checkpoints
from tests.conftest import read_records, train_losses
from tests.train.test_run import clean_env, run

pytestmark = pytest.mark.slow

QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"
JOIN_TIMEOUT_S = 60


def shrunk(tmp_path: Path, name: str, *extra: str) -> list[str]:
    """The quickstart with a micro model, short sequences and a few steps; global batch 8 either way."""
    return [
        "model.preset=micro",
        "data.seq_len=32",
        "batch.global_batch=8",
        "batch.micro_batch=2",
        "train.steps=6",
        "train.eval_every=100",
        "train.eval_batches=2",
        "train.save_every=2",
        "schedule.warmup_steps=2",
        f"train.output_dir={tmp_path / 'runs' / name}",
        f"data.cache_dir={tmp_path / 'cache'}",
        *extra,
    ]


def start_node(rank: int, port: int, overrides: list[str], timeout_s: int = JOIN_TIMEOUT_S) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "memtrain",
            "run",
            str(QUICKSTART),
            *overrides,
            "--nnodes",
            "2",
            "--node-rank",
            str(rank),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "--join-timeout",
            str(timeout_s),
        ],
        env=clean_env(OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def two_nodes(
    overrides: list[str], node1_overrides: list[str] | None = None, timeout_s: int = JOIN_TIMEOUT_S
) -> list[tuple[int, str]]:
    port = free_port()
    nodes = [start_node(0, port, overrides, timeout_s), start_node(1, port, node1_overrides or overrides, timeout_s)]
    return [(node.wait(timeout=600), node.stdout.read()) for node in nodes]


def final_eval_loss(run_dir: Path) -> float:
    return read_records(run_dir, "eval")[-1]["loss"]


def test_two_nodes_train_as_one_process_with_the_same_global_batch(tmp_path):
    overrides = shrunk(tmp_path, "two-nodes")
    for code, output in two_nodes(overrides):
        assert code == 0, output[-3000:]
        assert "node" in output and "Traceback" not in output
        assert "frame #" not in output and "TCPStore" not in output, output[-3000:]  # a clean teardown
    assert run(QUICKSTART, *shrunk(tmp_path, "one-process", "hardware.gpus=1")) == 0
    two, one = tmp_path / "runs" / "two-nodes", tmp_path / "runs" / "one-process"
    assert sorted(train_losses(two)) == list(range(1, 7))
    a, b = train_losses(one), train_losses(two)  # the whole batch's loss on both
    assert all(b[step] == pytest.approx(a[step], abs=1e-4) for step in a), (a, b)
    assert final_eval_loss(two) == pytest.approx(final_eval_loss(one), abs=1e-4)
    assert [p.name for p in complete_checkpoints(two)][-1] == "step-000006"  # written once, into the shared dir
    assert not list(two.glob(".memtrain-shared-*"))  # the shared-directory token is gone


def started_nodes(overrides: list[str], until) -> list:
    """Node 0 and node 1 of one run, returned once `until()` holds (or a node has ended, or 300 s passed)."""
    port = free_port()
    nodes = [start_node(0, port, overrides), start_node(1, port, overrides)]
    deadline = time.time() + 300
    while time.time() < deadline and not until() and all(n.poll() is None for n in nodes):
        time.sleep(0.2)
    return nodes


def test_two_nodes_stopped_by_sigterm_resume_exactly(tmp_path):
    overrides = shrunk(tmp_path, "killed", "train.steps=12")  # long enough to be stopped after step 2
    run_dir = tmp_path / "runs" / "killed"
    nodes = started_nodes(overrides, until=lambda: complete_checkpoints(run_dir))
    for node in nodes:  # as Slurm's scancel does: every node's launcher gets it
        node.send_signal(signal.SIGTERM)
    first = [(node.wait(timeout=300), node.stdout.read()) for node in nodes]
    for code, output in first:
        assert code == 143, output[-3000:]  # 128 + SIGTERM on both nodes, saved at the same step
    assert complete_checkpoints(run_dir)
    for code, output in two_nodes(overrides):
        assert code == 0, output[-3000:]
    assert run(QUICKSTART, *shrunk(tmp_path, "straight", "hardware.gpus=1", "train.steps=12")) == 0
    assert sorted(train_losses(run_dir)) == list(range(1, 13))  # each step once, after the resume too
    assert [r for r in read_records(run_dir, "run") if r.get("event") == "resume"]
    assert final_eval_loss(run_dir) == pytest.approx(final_eval_loss(tmp_path / "runs" / "straight"), abs=1e-4)


def test_sigterm_to_one_node_stops_both_with_its_code(tmp_path):
    """Node 0 got no signal, yet it stopped because node 1 did: it reports SIGTERM (143), not 130."""
    overrides = shrunk(tmp_path, "one-term", "train.steps=200", "train.save_every=100")
    run_dir = tmp_path / "runs" / "one-term"
    nodes = started_nodes(overrides, until=lambda: train_losses_or_none(run_dir))
    nodes[1].send_signal(signal.SIGTERM)
    for code, output in [(node.wait(timeout=300), node.stdout.read()) for node in nodes]:
        assert code == 143, output[-3000:]
    ends = [r for r in read_records(run_dir, "run") if r.get("event") == "end"]
    assert ends[-1]["status"] == "interrupted" and complete_checkpoints(run_dir)


def test_a_node_killed_with_sigkill_is_named_by_the_survivor_with_the_peer_lost_code(tmp_path):
    """Every process of node 1 (launcher, torchrun, worker) killed at once, as a lost machine: node 0's worker finds
    its collective broken, names node 1's rank (it misses the roll call on node 0's store) and ends with exit 69."""
    import psutil

    from memtrain.train.runtime.result import EXIT_PEER_LOST

    overrides = shrunk(tmp_path, "node-lost", "train.steps=200", "train.save_every=100")
    run_dir = tmp_path / "runs" / "node-lost"
    nodes = started_nodes(overrides, until=lambda: train_losses_or_none(run_dir))
    node1 = psutil.Process(nodes[1].pid)
    for process in [node1, *node1.children(recursive=True)]:
        process.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    output, _ = nodes[0].communicate(timeout=120)
    nodes[1].communicate(timeout=60)
    assert nodes[0].returncode == EXIT_PEER_LOST, output[-3000:]
    assert time.monotonic() - killed_at < 30, output[-3000:]
    assert "Traceback" not in output and "Connection reset" not in output and "frame #" not in output, output[-3000:]
    said = [line for line in output.splitlines() if "rank 1 (node 1)" in line]
    assert len(said) == 1 and "ended without a word" in said[0] and "run the same command" in said[0], output[-3000:]
    ends = [r for r in read_records(run_dir, "run") if r.get("event") == "end"]
    assert ends and ends[-1]["status"] == "peer_lost", ends


def train_losses_or_none(run_dir: Path) -> dict | None:
    metrics = run_dir / "metrics.jsonl"
    return train_losses(run_dir) if metrics.exists() and '"train"' in metrics.read_text() else None


def test_a_different_recipe_on_node_1_stops_both_nodes_with_exit_2(tmp_path):
    overrides = shrunk(tmp_path, "mismatch")
    started = time.monotonic()
    results = two_nodes(overrides, [*overrides, "optimizer.lr=0.004"])
    elapsed = time.monotonic() - started
    for code, output in results:
        assert code == 2, output[-3000:]
        assert "optimizer.lr is 0.003 on node 0, 0.004 on node 1" in output, output[-3000:]
        assert "Traceback" not in output
    assert elapsed < JOIN_TIMEOUT_S + 60  # refused once joined, not at the timeout
    assert not complete_checkpoints(tmp_path / "runs" / "mismatch")


def test_a_node_that_cannot_reach_the_master_gives_up_within_the_timeout(tmp_path):
    started = time.monotonic()
    node = start_node(1, free_port(), shrunk(tmp_path, "alone"), timeout_s=5)
    output, _ = node.communicate(timeout=120)
    assert node.returncode == 2, output[-3000:]
    assert "did not all join" in output and "Traceback" not in output, output[-3000:]
    assert "frame #" not in output and "socket.cpp" not in output, output[-3000:]  # torchrun's C++ log lines
    assert time.monotonic() - started < 60


def start_with_hostfile(tmp_path: Path, overrides: list[str]) -> subprocess.Popen:
    """`memtrain run --hostfile` for two 'machines' on this one: the second host's node is started through a
    remote shell that is a real second process (a script that runs its command here, whatever the host)."""
    remote_shell = tmp_path / "fake-ssh"
    remote_shell.write_text('#!/bin/sh\n# fake-ssh HOST COMMAND: run COMMAND here\nshift\nexec sh -c "$*"\n')
    remote_shell.chmod(0o755)
    hosts = tmp_path / "hostfile"
    hosts.write_text("# two 'machines' on this one\nlocalhost slots=1\n127.0.0.1 slots=1\n")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "memtrain",
            "run",
            str(QUICKSTART),
            *overrides,
            "--hostfile",
            str(hosts),
            "--remote-shell",
            str(remote_shell),
            "--master-port",
            str(free_port()),
            "--join-timeout",
            str(JOIN_TIMEOUT_S),
        ],
        env=clean_env(OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_one_command_with_a_hostfile_starts_both_nodes_and_trains_as_one_process(tmp_path):
    launcher = start_with_hostfile(tmp_path, shrunk(tmp_path, "hostfile"))
    output, _ = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, output[-3000:]
    assert "Traceback" not in output
    assert "localhost: " in output and "127.0.0.1: " in output  # each node's lines, prefixed with its host
    assert "127.0.0.1: · node 1 of 2, rendezvous at localhost:" in output
    assert run(QUICKSTART, *shrunk(tmp_path, "one-process", "hardware.gpus=1")) == 0
    two, one = tmp_path / "runs" / "hostfile", tmp_path / "runs" / "one-process"
    assert sorted(train_losses(two)) == list(range(1, 7))
    assert final_eval_loss(two) == pytest.approx(final_eval_loss(one), abs=1e-4)


def test_sigterm_to_the_hostfile_launcher_stops_every_node_at_one_checkpoint(tmp_path):
    run_dir = tmp_path / "runs" / "hostfile-killed"
    launcher = start_with_hostfile(tmp_path, shrunk(tmp_path, "hostfile-killed", "train.steps=12"))
    deadline = time.time() + 300
    while time.time() < deadline and not complete_checkpoints(run_dir) and launcher.poll() is None:
        time.sleep(0.2)
    launcher.send_signal(signal.SIGTERM)  # forwarded to node 0 and to the remote shell of node 1
    output, _ = launcher.communicate(timeout=300)
    assert launcher.returncode == 143, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    saved = [p.name for p in complete_checkpoints(run_dir)]
    assert saved and saved[-1] != "step-000012"  # stopped early, after a complete checkpoint
