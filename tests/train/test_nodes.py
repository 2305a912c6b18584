"""Which node this is and where the rendezvous is: flags first, then torchrun's and Slurm's environment."""
from __future__ import annotations

import pytest

from memtrain.errors import UserError
from memtrain.train.nodes import DEFAULT_MASTER_PORT, NodeFlags, Rendezvous, _differences, node_count, rendezvous_for


def test_one_node_needs_nothing_and_ignores_a_stale_master_in_the_environment():
    meet = rendezvous_for(1, NodeFlags(), {"MASTER_ADDR": "elsewhere", "NODE_RANK": "3"})
    assert (meet.nodes, meet.node_rank, meet.master_addr) == (1, 0, "127.0.0.1") and meet.is_first


def test_flags_win_over_the_environment():
    env = {"MASTER_ADDR": "envhost", "MASTER_PORT": "1234", "NODE_RANK": "0", "SLURM_NNODES": "4"}
    flags = NodeFlags(nnodes=2, node_rank=1, master_addr="node0", master_port=29400, join_timeout_s=30)
    assert node_count(flags, env) == 2
    meet = rendezvous_for(2, flags, env)
    assert meet == Rendezvous(2, 1, "node0", 29400, 30)
    assert meet.torchrun_flags() == ["--nnodes=2", "--node_rank=1", "--master_addr=node0", "--master_port=29400",
                                     "--rdzv_conf", "timeout=30"]


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
    assert _differences(first, other) == ["flags is ['--resume'] on node 0, ['--no-resume'] on node 1",
                                          "optimizer.lr is 0.003 on node 0, 0.004 on node 1"]
    assert _differences(first, dict(first, node=1)) == []
