"""Several nodes: ZeRO partitions over nodes × gpus ranks, host memory is each node's, and the global
batch must split over the whole world."""

from __future__ import annotations

import pytest

from memtrain.errors import RecipeError
from memtrain.plan.planner import micro_batch_candidates, plan_recipe
from memtrain.recipe.load import load_recipe_text

OFFLOADED_ZERO3 = """
model: {preset: tiny}
data: {train: builtin:shakespeare, seq_len: 64}
hardware: {gpus: %d, nodes: %d, gpu: 24GiB}
precision: {compute: bf16, chunked_loss: false}
offload: {zero_stage: 3, optimizer: cpu, params: cpu}
batch: {global_batch: %d, micro_batch: 2}
train: {steps: 10}
"""


def recipe(gpus: int, nodes: int, global_batch: int = 16, offload: str = "cpu"):
    text = (OFFLOADED_ZERO3 % (gpus, nodes, global_batch)).replace(
        "optimizer: cpu, params: cpu", f"optimizer: {offload}, params: {offload}"
    )
    return load_recipe_text(text).recipe


def test_a_rank_of_two_nodes_holds_what_a_rank_of_one_node_with_as_many_gpus_holds():
    one_node, two_nodes = plan_recipe(recipe(gpus=4, nodes=1)), plan_recipe(recipe(gpus=2, nodes=2))
    assert two_nodes.terms == one_node.terms  # ZeRO-3 over 4 ranks either way: the same per-GPU bytes
    assert two_nodes.peak_reserved_bytes == one_node.peak_reserved_bytes
    # each node holds its two ranks' shares of the offloaded states: half of the one machine's
    for key, value in one_node.host_breakdown.items():
        if key in ("optimizer_states", "master_weights", "params", "gradients", "baseline"):
            assert two_nodes.host_breakdown[key] == pytest.approx(value / 2, rel=0.02), key
    assert two_nodes.nodes == 2 and two_nodes.gpus == 2


def test_a_node_of_a_larger_world_holds_less_host_memory_than_a_lone_node():
    alone, of_four = plan_recipe(recipe(gpus=2, nodes=1)), plan_recipe(recipe(gpus=2, nodes=4))
    assert of_four.host_breakdown["optimizer_states"] == pytest.approx(
        alone.host_breakdown["optimizer_states"] / 4, rel=0.01
    )
    on_gpu_alone, on_gpu_of_four = plan_recipe(recipe(2, 1, offload="none")), plan_recipe(recipe(2, 4, offload="none"))
    assert on_gpu_of_four.terms["params"] == on_gpu_alone.terms["params"] // 4  # partitioned 8 ways, not 2
    assert on_gpu_of_four.terms["optimizer_states"] == pytest.approx(
        on_gpu_alone.terms["optimizer_states"] / 4, rel=0.01
    )


def test_micro_batches_divide_each_ranks_share_of_the_world():
    assert micro_batch_candidates(recipe(gpus=2, nodes=2)) == [1, 2, 4]  # 16 / 4 ranks


def test_a_world_that_does_not_divide_the_global_batch_is_refused_with_the_fix():
    with pytest.raises(RecipeError) as caught:
        recipe(gpus=2, nodes=3, global_batch=16)
    [problem] = caught.value.problems
    assert problem.key == "batch.global_batch"
    assert "nodes × gpus × micro_batch = 3 × 2 × 2" in problem.message and "multiple of 12" in problem.hint
