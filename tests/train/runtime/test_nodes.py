"""Which node this is and where the rendezvous is: flags first, then torchrun's and Slurm's environment."""

from __future__ import annotations

import io
import shlex
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memtrain.cli import app
from memtrain.errors import UserError
from memtrain.train.runtime.hostfile import Host, NodeCommand, read_hostfile, remote_command, run_nodes
from memtrain.train.runtime.nodes import (
    DEFAULT_MASTER_PORT,
    NodeFlags,
    Rendezvous,
    _differences,
    node_count,
    rendezvous_for,
)


def test_one_node_needs_nothing_and_ignores_a_stale_master_in_the_environment():
    meet = rendezvous_for(1, NodeFlags(), {"MASTER_ADDR": "elsewhere", "NODE_RANK": "3"})
    assert (meet.nodes, meet.node_rank, meet.master_addr) == (1, 0, "127.0.0.1") and meet.is_first


def test_flags_win_over_the_environment():
    env = {"MASTER_ADDR": "envhost", "MASTER_PORT": "1234", "NODE_RANK": "0", "SLURM_NNODES": "4"}
    flags = NodeFlags(nnodes=2, node_rank=1, master_addr="node0", master_port=29400, join_timeout_s=30)
    assert node_count(flags, env) == 2
    meet = rendezvous_for(2, flags, env)
    assert meet == Rendezvous(2, 1, "node0", 29400, 30)
    assert meet.torchrun_flags() == [
        "--nnodes=2",
        "--node_rank=1",
        "--master_addr=node0",
        "--master_port=29400",
        "--rdzv_conf",
        "timeout=30",
    ]


def test_slurm_says_the_node_count_and_rank_and_torchrun_variables_the_master():
    env = {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "MASTER_ADDR": "gpu-01"}
    assert node_count(NodeFlags(), env) == 2
    assert rendezvous_for(2, NodeFlags(), env) == Rendezvous(2, 1, "gpu-01", DEFAULT_MASTER_PORT)
    assert node_count(NodeFlags(), {}) is None  # the recipe's hardware.nodes


def test_several_nodes_without_a_rank_or_master_are_refused_with_the_flags_to_pass():
    with pytest.raises(UserError) as caught:
        rendezvous_for(2, NodeFlags(), {})
    text = " ".join(p.format() for p in caught.value.problems)
    assert "--node-rank" in text and "--master-addr" in text
    with pytest.raises(UserError, match="outside 0..1"):
        rendezvous_for(2, NodeFlags(node_rank=2, master_addr="a"), {})


def test_differences_name_recipe_keys_and_resolved_fields():
    first = {"node": 0, "run": {"recipe": {"optimizer": {"lr": 0.003}}, "micro_batch": 2}, "flags": ["--resume"]}
    other = {"node": 1, "run": {"recipe": {"optimizer": {"lr": 0.004}}, "micro_batch": 2}, "flags": ["--no-resume"]}
    assert _differences(first, other) == [
        "flags is ['--resume'] on node 0, ['--no-resume'] on node 1",
        "optimizer.lr is 0.003 on node 0, 0.004 on node 1",
    ]
    assert _differences(first, dict(first, node=1)) == []


# --- the hostfile: one command on the first node (DeepSpeed's launcher style) ---

QUICKSTART = Path(__file__).resolve().parents[3] / "recipes" / "quickstart.yaml"


def hostfile(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return path


def test_a_hostfile_lists_hosts_in_order_without_comments_or_blank_lines(tmp_path):
    path = hostfile(tmp_path, "# the cluster\nws1 slots=2   # this one\n\n  ws2  slots = 2\n")
    assert read_hostfile(path, gpus=2) == [Host("ws1", 2, 2), Host("ws2", 2, 4)]


@pytest.mark.parametrize(
    "text, gpus, where, what",
    [
        ("ws1 slots=2\nws2 slots=two\n", 2, ":2:", "cannot read 'ws2 slots=two'"),
        ("ws1 slots=2\nws2\n", 2, ":2:", "cannot read 'ws2'"),
        ("ws1 slots=2 extra\n", 2, ":1:", "cannot read"),
        ("ws1 slots=0\n", 2, ":1:", "cannot read"),
        ("ws1 slots=2\nws2 slots=1\n", 2, ":2:", "host ws2 has slots=1 but the recipe runs hardware.gpus=2"),
        ("ws1 slots=2\n# again\nws1 slots=2\n", 2, ":3:", "host ws1 is listed twice (first on line 1)"),
    ],
)
def test_a_bad_hostfile_line_is_refused_with_file_and_line(tmp_path, text, gpus, where, what):
    path = hostfile(tmp_path, text)
    with pytest.raises(UserError) as caught:
        read_hostfile(path, gpus)
    [problem] = caught.value.problems
    assert f"{path}{where}" in problem.format() and what in problem.format() and problem.hint


def test_an_empty_or_missing_hostfile_is_refused(tmp_path):
    with pytest.raises(UserError, match="names no host"):
        read_hostfile(hostfile(tmp_path, "# nothing yet\n\n"), 1)
    with pytest.raises(UserError, match="cannot read the hostfile"):
        read_hostfile(tmp_path / "missing", 1)


def test_a_remote_node_runs_the_same_interpreter_and_arguments_in_the_same_directory():
    argv = ["run", "my recipe.yaml", "optimizer.lr=3e-4", "--nnodes", "2", "--node-rank", "1"]
    env = {"NCCL_SOCKET_IFNAME": "eth0", "MASTER_ADDR": "stale", "HOME": "/home/me", "PYTHONPATH": "/src"}
    command = remote_command("ws2", argv, "ssh -p 2222", Path("/shared/my work"), env)
    assert command[:4] == ["ssh", "-p", "2222", "ws2"] and len(command) == 5
    assert shlex.split(command[4]) == [
        "cd",
        "/shared/my work",
        "&&",
        "exec",
        "env",
        "NCCL_SOCKET_IFNAME=eth0",
        "PYTHONPATH=/src",
        sys.executable,
        "-m",
        "memtrain",
        *argv,
    ]


def test_the_cli_refuses_a_bad_hostfile_with_exit_2_before_starting_anything(tmp_path):
    path = hostfile(tmp_path, "localhost slots=1\nlocalhost slots=1\n")
    result = CliRunner().invoke(app, ["run", str(QUICKSTART), "--hostfile", str(path), "--remote-shell", "false"])
    assert result.exit_code == 2 and f"{path}:2" in result.output and "listed twice" in result.output
    assert "Traceback" not in result.output
    result = CliRunner().invoke(app, ["run", str(QUICKSTART), "--hostfile", str(path), "--node-rank", "1"])
    assert result.exit_code == 2 and "--node-rank cannot go with --hostfile" in result.output


def test_every_node_s_output_is_prefixed_with_its_host_and_the_worst_code_wins():
    out = io.StringIO()
    code = run_nodes(
        [
            NodeCommand("a", ["sh", "-c", "echo one; exit 0"]),
            NodeCommand("bb", ["sh", "-c", "echo two; echo three >&2; exit 3"]),
        ],
        out,
    )
    assert code == 3
    assert sorted(out.getvalue().splitlines()) == [" a: one", "bb: three", "bb: two"]


def test_a_node_that_fails_stops_the_others_instead_of_leaving_them_to_wait_out_the_join_timeout():
    out = io.StringIO()
    started = time.monotonic()
    code = run_nodes(
        [NodeCommand("ws1", ["sh", "-c", "echo refused; exit 2"]), NodeCommand("ws2", ["sh", "-c", "sleep 60"])],
        out,
        poll_s=0.05,
    )
    assert code == 2 and time.monotonic() - started < 30  # node 0's code, not the 143 of the node it stopped
    assert out.getvalue() == "ws1: refused\n"
