"""PyTorch's variable-length flash kernel for packed rows: the sample bounds it is given, when memtrain picks it,
and (on a CUDA GPU of compute capability 8.0+) that packed rows through it train like their samples one by one.

The CPU tests build the bounds from position ids laid out as memtrain's rows are (data/rows/row_set.py: every
sample restarts at 0, padding continues the last sample) and check the recipe's choice; the packed-equals-samples
proof of the wrapper and the flattening on the CPU is tests/data/rows/test_packing.py (VARLEN). The GPU test runs the
real kernel in bf16 against the same model's samples one at a time through sdpa.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from memtrain.errors import UserError
from memtrain.model.architecture import check_attention_kernel
from memtrain.model.attention import packs_steps, resolve_attention, with_attention
from memtrain.model.config import model_config
from memtrain.model.varlen import ATTN_NAME, attend_by_sample, packed_sequences, varlen_available
from memtrain.model.wrapper import TrainableLM, check_packed_attention
from memtrain.recipe.load import load_recipe_text
from memtrain.recipe.schema import Model, Precision
from tests.model.families import tiny_config

IGNORE = -100


def rows(samples_per_row: list[list[int]], seq_len: int) -> torch.Tensor:
    """Position ids of rows holding samples of these lengths, as memtrain lays them out (padding continues)."""
    out = []
    for lengths in samples_per_row:
        positions = [p for n in lengths for p in range(n)]
        positions += range(positions[-1] + 1, positions[-1] + 1 + seq_len - len(positions))
        out.append(positions)
    return torch.tensor(out)


def test_bounds_of_rows_ending_in_padding_count_it_into_their_last_sample():
    got = packed_sequences(rows([[3, 4], [5]], seq_len=10))
    # row 0: samples at 0 and 3, the second runs to the row's end (4 tokens and 3 of padding); row 1 starts at 10
    assert got["cu_seq_lens_q"].tolist() == [0, 3, 10, 20]
    assert got["cu_seq_lens_q"].dtype == torch.int32
    assert got["cu_seq_lens_k"] is got["cu_seq_lens_q"]
    assert got["max_length_q"] == got["max_length_k"] == 10
    assert isinstance(got["max_length_q"], int)


def test_bounds_of_a_sample_that_fills_its_row():
    got = packed_sequences(rows([[8], [2, 2, 4], [1, 7]], seq_len=8))
    assert got["cu_seq_lens_q"].tolist() == [0, 8, 10, 12, 16, 17, 24]
    assert got["max_length_q"] == 8


def test_bounds_of_several_rows_flattened_and_of_one_row():
    several = packed_sequences(rows([[2, 3], [4, 1], [5]], seq_len=6))
    assert several["cu_seq_lens_q"].tolist() == [0, 2, 6, 10, 12, 18]
    assert several["max_length_q"] == 6
    one = packed_sequences(rows([[2, 2, 2]], seq_len=6))
    assert one["cu_seq_lens_q"].tolist() == [0, 2, 4, 6]
    assert one["max_length_q"] == 6


def test_the_bound_on_sample_length_is_the_row_width_whatever_the_samples():
    """Compiled layers guard on this value: one bound for every batch of a run means no recompile when the longest
    sample changes (the kernel's grid blocks past a sample's end return at once)."""
    short = packed_sequences(rows([[1, 1, 1, 1], [2, 2]], seq_len=64))
    long = packed_sequences(rows([[60], [30, 30]], seq_len=64))
    assert short["max_length_q"] == long["max_length_q"] == short["max_length_k"] == 64


def test_rows_must_start_a_sample():
    with pytest.raises(ValueError, match="start with position id 0"):
        packed_sequences(torch.tensor([[3, 4, 5, 0, 1]]))


def test_attention_by_sample_never_crosses_a_bound():
    """The reference the kernel is held to: changing one sample's keys and values leaves the others' outputs."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(12, 4, 8) for _ in range(3))
    bounds = torch.tensor([0, 5, 12], dtype=torch.int32)
    out = attend_by_sample(q, k, v, bounds)
    k2, v2 = k.clone(), v.clone()
    k2[:5], v2[:5] = torch.randn(5, 4, 8), torch.randn(5, 4, 8)
    changed = attend_by_sample(q, k2, v2, bounds)
    torch.testing.assert_close(changed[5:], out[5:])
    assert not torch.allclose(changed[:5], out[:5])
    # the second sample alone, causal, is what its rows hold
    alone = torch.nn.functional.scaled_dot_product_attention(
        q[5:].transpose(0, 1), k[5:].transpose(0, 1), v[5:].transpose(0, 1), is_causal=True
    ).transpose(0, 1)
    torch.testing.assert_close(out[5:], alone)


RECIPE = """
model: {{preset: {preset}, tokenizer: "builtin:shakespeare-chat", attn_implementation: {attention}}}
data: {{train: [{{path: "builtin:chat", type: chat}}], seq_len: 128, packing: {packing}}}
precision: {{compute: {compute}}}
batch: {{global_batch: 8, micro_batch: 4}}
train: {{steps: 4}}
"""


def recipe(attention="auto", packing="true", compute="bf16", preset="tiny"):
    text = RECIPE.format(attention=attention, packing=packing, compute=compute, preset=preset)
    return load_recipe_text(text, check=False).recipe


@pytest.mark.parametrize(
    "kwargs, varlen, expected",
    [
        ({}, True, "varlen"),  # packed chat on a card that runs it
        ({}, False, "sdpa"),  # the CPU keeps today's path
        ({"packing": "false"}, True, "varlen"),  # unpacked: laid out packed within each step (loader.py)
        ({"packing": "false"}, False, "sdpa"),
        ({"compute": "fp32"}, True, "sdpa"),  # the flash kernel takes fp16 / bf16 only
        ({"compute": "fp16"}, True, "varlen"),
        ({"attention": "sdpa"}, True, "sdpa"),  # asked for: kept
        ({"attention": "eager"}, True, "eager"),
    ],
)
def test_auto_takes_varlen_for_sample_rows_where_it_runs(kwargs, varlen, expected):
    assert resolve_attention(recipe(**kwargs), varlen=varlen) == expected


PAIRS = """
model: {{preset: tiny, tokenizer: "builtin:shakespeare-chat"}}
data: {{train: [{{path: "builtin:preference", type: {kind}}}], seq_len: 128}}
batch: {{global_batch: 8, micro_batch: 2}}
train: {{steps: 4, objective: {objective}}}
"""


@pytest.mark.parametrize(
    "kind, objective, varlen, expected",
    [
        ("preference", "dpo", True, "varlen"),  # pairs laid end to end within each step
        ("preference", "orpo", True, "varlen"),
        ("preference", "dpo", False, "sdpa"),  # the CPU: pairs cut to their longest, padding masked
        ("kto", "kto", True, "sdpa"),  # KTO's records and KL rows run apart: kept as rows
    ],
)
def test_auto_takes_varlen_for_preference_pairs_and_lays_them_out_packed(kind, objective, varlen, expected):
    pairs = load_recipe_text(PAIRS.format(kind=kind, objective=objective), check=False).recipe
    attention = resolve_attention(pairs, varlen=varlen)
    assert attention == expected
    resolved = with_attention(pairs, attention)
    assert packs_steps(resolved) == (expected == "varlen")


def test_text_windows_keep_sdpa():
    """data.train as one path: windows of concatenated text, one sequence per row (no restarts to keep apart)."""
    text = load_recipe_text(
        'model: {preset: tiny}\ndata: {train: "builtin:shakespeare", seq_len: 64}\n'
        "batch: {global_batch: 4, micro_batch: 2}\ntrain: {steps: 1}\n",
        check=False,
    ).recipe
    assert resolve_attention(text, varlen=True) == "sdpa"


def test_varlen_in_fp32_is_refused_with_the_key():
    with pytest.raises(UserError) as caught:
        resolve_attention(recipe(attention="varlen", compute="fp32"), varlen=True)
    assert caught.value.problems[0].key == "model.attn_implementation"


def test_varlen_is_refused_before_a_run_where_the_kernel_cannot_run():
    with pytest.raises(UserError) as caught:
        check_attention_kernel("varlen", on_gpu=False, varlen_runs=False)
    assert "compute capability 8.0" in caught.value.problems[0].message
    check_attention_kernel("varlen", on_gpu=True, varlen_runs=True)  # an Ampere or newer card: no complaint
    check_attention_kernel("auto", on_gpu=False)  # auto never needs it


def test_model_is_built_with_the_registered_kernel_and_gemma2_keeps_eager():
    assert model_config(Model(preset="tiny", attn_implementation="varlen"))._attn_implementation == ATTN_NAME
    assert model_config(Model(preset="tiny"))._attn_implementation == "sdpa"  # auto, unresolved: sdpa
    # Gemma-2's soft-capped attention scores: the kernel has no cap, so eager, as for sdpa
    assert model_config(Model(preset="gemma2-9b", attn_implementation="varlen"))._attn_implementation == "eager"


def _tiny_gqa_llama(dtype: torch.dtype, device: str) -> TrainableLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 64
        num_key_value_heads=2,  # grouped-query attention, as Qwen2.5 and Llama-3 have
        intermediate_size=512,
        vocab_size=512,
        max_position_embeddings=512,
        attn_implementation=ATTN_NAME,
    )
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype)
    return TrainableLM(model, Precision(compute="bf16" if dtype == torch.bfloat16 else "fp32"))


def _packed_batch(lengths_per_row: list[list[int]], seq_len: int, device: str) -> tuple[dict, list[dict]]:
    """Rows as memtrain builds them (labels -100 on each sample's first token and on padding) and the samples."""
    generator = torch.Generator().manual_seed(1)
    ids, labels, samples = [], [], []
    for lengths in lengths_per_row:
        row_ids, row_labels = [], []
        for n in lengths:
            tokens = torch.randint(1, 512, (n,), generator=generator)
            targets = tokens.clone()
            targets[0] = IGNORE
            row_ids.append(tokens)
            row_labels.append(targets)
            samples.append({"input_ids": tokens[None].to(device), "labels": targets[None].to(device)})
        pad = seq_len - sum(lengths)
        ids.append(torch.cat([*row_ids, torch.zeros(pad, dtype=torch.long)]))
        labels.append(torch.cat([*row_labels, torch.full((pad,), IGNORE)]))
    batch = {
        "input_ids": torch.stack(ids).to(device),
        "labels": torch.stack(labels).to(device),
        "position_ids": rows(lengths_per_row, seq_len).to(device),
    }
    return batch, samples


def _loss_and_grads(model: TrainableLM, batch: dict) -> tuple[torch.Tensor, int, dict]:
    model.zero_grad(set_to_none=True)
    loss_sum, n_targets = model(**batch)
    loss_sum.backward()
    return loss_sum.detach().float(), int(n_targets), {n: p.grad.float().clone() for n, p in model.named_parameters()}


@pytest.mark.skipif(not varlen_available(), reason="needs a CUDA GPU of compute capability 8.0+ with varlen_attn")
def test_packed_rows_through_the_kernel_equal_their_samples_one_by_one_in_bf16():
    """Rows ending in padding, a sample filling its row, grouped-query attention; bf16 on both sides, so the
    tolerance is bf16's: the loss within 1 %, every gradient within 3 % of its norm."""
    model = _tiny_gqa_llama(torch.bfloat16, "cuda")
    batch, samples = _packed_batch([[37, 50, 41], [160], [7, 100, 20]], seq_len=160, device="cuda")
    packed_loss, packed_n, packed_grads = _loss_and_grads(model, batch)

    total, count, grads = torch.zeros((), device="cuda"), 0, None
    model.model.config._attn_implementation = "sdpa"  # the samples alone: PyTorch's causal sdpa, no bounds needed
    try:
        for sample in samples:
            loss, n, g = _loss_and_grads(model, sample)
            total, count = total + loss, count + n
            grads = g if grads is None else {k: grads[k] + g[k] for k in grads}
    finally:
        model.model.config._attn_implementation = ATTN_NAME

    assert packed_n == count == sum(int((s["labels"] != IGNORE).sum()) for s in samples)
    torch.testing.assert_close(packed_loss, total, rtol=1e-2, atol=0.0)
    for name, grad in packed_grads.items():
        error = (grad - grads[name]).norm() / grads[name].norm().clamp_min(1e-12)
        assert error < 3e-2, f"{name}: relative gradient error {error:.3g}"


@pytest.mark.skipif(not varlen_available(), reason="needs a CUDA GPU of compute capability 8.0+ with varlen_attn")
def test_compiled_layers_compile_once_for_batches_of_any_sample_count():
    """Packed micro-batches differ in how many samples they hold and in their longest one; a compiled layer that
    guarded on either would recompile in the middle of a run (measured: 4 s in the fourth step on an H100)."""
    from torch._dynamo.testing import CompileCounterWithBackend  # noqa: PLC0415 — GPU-only test

    model = _tiny_gqa_llama(torch.bfloat16, "cuda")
    counter = CompileCounterWithBackend("inductor")
    for layer in model.model.model.layers:
        layer.compile(backend=counter)

    def train_on(lengths_per_row: list[list[int]]) -> None:
        batch, _ = _packed_batch(lengths_per_row, seq_len=128, device="cuda")
        loss, _ = model(**batch)
        loss.backward()

    train_on([[37, 50, 41], [128]])
    compiled = counter.frame_count
    train_on([[7, 100, 20], [64, 64]])
    train_on([[10] * 12, [3, 125]])
    assert compiled >= 1 and counter.frame_count == compiled


def test_a_kernel_that_would_mix_packed_samples_is_refused_naming_the_recipe_values():
    check_packed_attention(ATTN_NAME)  # varlen keeps them apart
    with pytest.raises(UserError) as caught:
        check_packed_attention("paged|eager")
    problem = caught.value.problems[0]
    assert problem.key == "model.attn_implementation" and "varlen" in problem.hint and ATTN_NAME not in problem.hint


# Every shipped family but Gemma-2 (soft-capped scores: eager); phi3 with a window shorter than its samples, so the
# sliding-window bound (window_size (W - 1, 0)) is checked against transformers' own sliding mask
FAMILIES = [("llama", {}), ("qwen2", {}), ("qwen3", {}), ("mistral", {}), ("phi3", {"sliding_window": 24})]


def _family_model(family: str, overrides: dict, dtype: torch.dtype, device: str) -> TrainableLM:
    torch.manual_seed(0)
    config = tiny_config(family, attn_implementation=ATTN_NAME, **overrides)
    model = AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype)
    return TrainableLM(model, Precision(compute="bf16" if dtype == torch.bfloat16 else "fp32"))


def _packed_against_samples(model: TrainableLM, device: str):
    batch, samples = _packed_batch([[37, 50, 41], [128], [7, 100, 20]], seq_len=128, device=device)
    batch["input_ids"] = batch["input_ids"] % 4096  # the families' tiny vocabulary
    for sample in samples:
        sample["input_ids"] = sample["input_ids"] % 4096
        sample["labels"] = torch.where(sample["labels"] == IGNORE, IGNORE, sample["labels"] % 4096)
    batch["labels"] = torch.where(batch["labels"] == IGNORE, IGNORE, batch["labels"] % 4096)
    packed = _loss_and_grads(model, batch)
    total, grads = None, None
    model.model.config._attn_implementation = "sdpa"
    try:
        for sample in samples:
            loss, _, g = _loss_and_grads(model, sample)
            total = loss if total is None else total + loss
            grads = g if grads is None else {k: grads[k] + g[k] for k in grads}
    finally:
        model.model.config._attn_implementation = ATTN_NAME
    return packed, (total, grads)


@pytest.mark.parametrize("family, overrides", FAMILIES)
def test_every_family_passes_the_bounds_to_its_attention_in_fp32(family, overrides):
    """On the CPU the same attention function attends sample by sample: each family's layers hand it the bounds
    (and phi3 its window), and the packed loss and gradients are the samples' one by one."""
    model = _family_model(family, overrides, torch.float32, "cpu")
    (packed_loss, _, packed_grads), (loss, grads) = _packed_against_samples(model, "cpu")
    torch.testing.assert_close(packed_loss, loss, rtol=1e-5, atol=1e-5)
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, grads[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.skipif(not varlen_available(), reason="needs a CUDA GPU of compute capability 8.0+ with varlen_attn")
@pytest.mark.parametrize("family, overrides", FAMILIES)
def test_every_family_through_the_kernel_equals_its_samples_in_bf16(family, overrides):
    model = _family_model(family, overrides, torch.bfloat16, "cuda")
    (packed_loss, _, packed_grads), (loss, grads) = _packed_against_samples(model, "cuda")
    torch.testing.assert_close(packed_loss, loss, rtol=1e-2, atol=0.0)
    for name, grad in packed_grads.items():
        error = (grad - grads[name]).norm() / grads[name].norm().clamp_min(1e-12)
        assert error < 3e-2, f"{family} {name}: relative gradient error {error:.3g}"
