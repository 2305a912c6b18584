"""FlashAttention-2's backward workspace (plan/attention_backward.py) against a GPU memory trace, and what the
planner makes of it: a packed row of many short samples raises the peak, a text window does not move it."""

from __future__ import annotations

from pathlib import Path

import pytest

from memtrain.model.config import model_config
from memtrain.plan.attention_backward import flash_backward_bytes, sequences_in_micro_batch
from memtrain.plan.planner import plan_recipe
from memtrain.recipe.load import load_recipe
from memtrain.recipe.schema import Model

MiB = 2**20
ROOT = Path(__file__).resolve().parents[2]
LONG = ROOT / "recipes/qwen2.5-7b-lora-long-24gb.yaml"


def test_the_workspace_is_the_seven_blocks_the_gpu_trace_found():
    """benchmarks/segments/peaks-qwen2.5-7b-32k.json: at the training peak, the varlen backward of one layer held
    2,309.2 MiB in 7 blocks (dq, dk, dv, dk and dv at 28 heads, dq_accum, softmax_d) for a 32,768-token row of 636
    conversations."""
    config = model_config(Model(preset="qwen2.5-7b"))
    workspace = flash_backward_bytes(config, tokens=32_768, sequences=636, compute_bytes=2)
    assert workspace / MiB == pytest.approx(2309.2, abs=0.5)
    # each further sequence: 128 rows of dq_accum and softmax_d (28 heads x (128 + 1) fp32)
    one_more = flash_backward_bytes(config, tokens=32_768, sequences=637, compute_bytes=2) - workspace
    assert one_more == 128 * 28 * 129 * 4


def test_without_grouped_query_heads_nothing_is_expanded():
    config = model_config(Model(preset="llama2-7b"))  # 32 query and 32 key/value heads
    tokens = 4096
    gradients = tokens * 96 * 128 * 2
    accumulators = (tokens + 128) * 32 * 129 * 4
    assert flash_backward_bytes(config, tokens=tokens, sequences=1, compute_bytes=2) == gradients + accumulators


def test_sequences_a_micro_batch_holds():
    assert sequences_in_micro_batch(rows=2, seq_len=4096, densest_row_samples=None, packed=False) == 2
    assert sequences_in_micro_batch(rows=2, seq_len=4096, densest_row_samples=40, packed=True) == 80
    assert (
        sequences_in_micro_batch(rows=1, seq_len=32_768, densest_row_samples=None, packed=True) == 128
    )  # 256 a sample


def _plan(overrides, densest):
    return plan_recipe(
        load_recipe(LONG, overrides, check=False).recipe, exact_pinned=False, densest_row_samples=densest
    )


def test_a_row_of_many_short_samples_raises_the_long_recipes_peak_by_the_kernels_rows():
    """Measured per step on the GPU (allocated): 18.77 GiB for the row of 636 samples, 19.30 for 941, 19.96 for
    1,324; the plan follows the kernel's extra rows from one row to the next."""
    at = {n: _plan([], n).peak_allocated_bytes for n in (636, 941, 1324)}
    per_sequence = 128 * 28 * 129 * 4
    assert at[941] - at[636] == pytest.approx(305 * per_sequence, rel=0.01)
    assert at[1324] - at[941] == pytest.approx(383 * per_sequence, rel=0.01)
    measured = {636: 18.77, 941: 19.30, 1324: 19.96}
    for n, gib in measured.items():  # on the safe side, within 2 %
        assert 0 <= at[n] / 2**30 / gib - 1 < 0.02, n


def test_a_few_long_samples_leave_the_mlp_phase_the_peak():
    few, none = _plan([], 8), _plan([], 1)
    assert few.peak_allocated_bytes == none.peak_allocated_bytes


def test_text_windows_are_one_sequence_a_row_whatever_the_count():
    text = ["data.train=builtin:shakespeare", "data.validation=null", "data.seq_len=4096"]
    assert _plan(text, None).peak_allocated_bytes == _plan(text, 5000).peak_allocated_bytes


def test_a_step_laid_out_packed_holds_no_more_sequences_than_the_step():
    """Unpacked chat laid out packed at run time: a micro-batch's rows come from one step's samples only."""
    chat = [
        "data.packing=false",
        "data.seq_len=4096",
        "checkpointing.mlp_tiles=0",
        "checkpointing.offload_inputs=false",
        "batch.micro_batch=2",
        "batch.global_batch=6",
    ]
    plan = _plan(chat, 1000)
    assert plan.packed_sequences == 6  # not 2 rows x 1,000
    assert _plan(chat, None).packed_sequences == 6  # nor 2 rows x 16 assumed samples of 256 tokens
    assert _plan([*chat[:-1], "batch.global_batch=64"], 3).packed_sequences == 6  # 2 rows x 3
