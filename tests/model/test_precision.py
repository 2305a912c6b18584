"""Precision map (fp32 islands) and the chunked loss: dtypes where they are asked, and the same math."""

from __future__ import annotations

import pytest
import torch

from memtrain.errors import RecipeError
from memtrain.model.loss import causal_lm_loss
from memtrain.model.precision import apply_precision
from memtrain.model.wrapper import TrainableLM
from memtrain.recipe.schema import Precision
from tests.model.test_support import one_torch_thread, shakespeare_batches, tiny_llama  # noqa: F401

ISLANDS = ["*norm*", "lm_head"]


def _outputs_by_name(model, names):
    seen = {}
    modules = dict(model.named_modules())
    for name in names:
        modules[name].register_forward_hook(lambda _m, _i, out, n=name: seen.setdefault(n, out))
    return seen


def test_islands_are_fp32_and_the_rest_is_in_the_compute_dtype():
    model = tiny_llama()
    islands = apply_precision(model, Precision(compute="bf16", fp32_modules=ISLANDS))
    assert islands == [
        *(f"model.layers.{i}.{n}" for i in range(4) for n in ("input_layernorm", "post_attention_layernorm")),
        "model.norm",
        "lm_head",
    ]
    for name, p in model.named_parameters():
        expected = torch.float32 if "norm" in name or name.startswith("lm_head") else torch.bfloat16
        assert p.dtype == expected, name
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # buffers keep their dtype
    watched = [
        "model.layers.1.input_layernorm",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.mlp",
        "model.layers.1",
        "lm_head",
    ]
    outputs = _outputs_by_name(model, watched)
    ids = shakespeare_batches(1)[0]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    assert outputs["lm_head"].dtype == torch.float32  # logits go straight into the fp32 loss
    for name in watched[:-1]:
        assert outputs[name].dtype == torch.bfloat16, name  # an island hands back the compute dtype


def test_an_island_computes_in_fp32():
    """The norm's bf16 output is its fp32 result rounded once, not a bf16 computation."""
    model = tiny_llama()
    norm = model.model.layers[0].input_layernorm
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    apply_precision(model, Precision(compute="bf16", fp32_modules=["model.layers.0.input_layernorm"]))
    x = torch.randn(2, 8, 64).to(torch.bfloat16) * 3
    x32 = x.float()
    reference = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))
    out = norm(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, reference.to(torch.bfloat16))
    # The same norm with bf16 weights, as without the island, rounds differently somewhere.
    other = tiny_llama().model.layers[0].input_layernorm
    other.weight.data = norm.weight.data.to(torch.bfloat16)
    assert not torch.equal(other(x), out)


def test_island_weights_cast_to_bf16_by_deepspeed_still_compute_in_fp32_and_get_gradients():
    """DeepSpeed's bf16 engine casts every parameter; the island then upcasts inside its forward."""
    model = tiny_llama()
    apply_precision(model, Precision(compute="bf16", fp32_modules=["lm_head"]))
    model.lm_head.weight.data = model.lm_head.weight.data.to(torch.bfloat16)  # what deepspeed.initialize does
    h = torch.randn(4, 64, dtype=torch.bfloat16)
    logits = model.lm_head(h)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, h.float() @ model.lm_head.weight.float().t())
    logits.sum().backward()
    assert model.lm_head.weight.grad.dtype == torch.bfloat16
    assert isinstance(model.lm_head.weight, torch.nn.Parameter)


def test_bf16_with_fp32_islands_and_loss_is_close_to_pure_fp32():
    ids = shakespeare_batches(1)[0]
    precision = Precision(compute="bf16", fp32_modules=ISLANDS, fp32_loss=True, loss_chunk_tokens=16)
    fp32_sum, n = TrainableLM(tiny_llama(), Precision(compute="fp32"))(input_ids=ids, labels=ids)
    model = tiny_llama()
    apply_precision(model, precision)
    bf16_sum, n_bf16 = TrainableLM(model, precision)(input_ids=ids, labels=ids)
    assert bf16_sum.dtype == torch.float32 and n == n_bf16 == 62
    assert abs(bf16_sum.item() / fp32_sum.item() - 1) < 2**-7  # bf16 has 8 significant bits


def test_unknown_fp32_module_pattern_is_a_recipe_error():
    with pytest.raises(RecipeError, match="'layer_norm' matches no module") as err:
        apply_precision(tiny_llama(), Precision(compute="bf16", fp32_modules=["layer_norm"]))
    assert err.value.problems[0].key == "precision.fp32_modules"


@pytest.mark.parametrize("chunk_tokens", [16, 25, 61])
def test_chunked_loss_equals_full_loss_and_gradients(chunk_tokens):
    torch.manual_seed(0)
    model = tiny_llama()
    hidden = torch.randn(3, 21, 64, requires_grad=True)
    labels = shakespeare_batches(1, micro_batch=3, seq_len=21)[0].clone()
    labels[0, 5:9] = -100
    labels[2, -3:] = -100
    full, n_full = causal_lm_loss(model.lm_head, hidden, labels, chunk_tokens=None)
    (full / n_full).backward()  # the mean token loss is what training differentiates
    full_grads = hidden.grad.clone(), model.lm_head.weight.grad.clone()
    hidden.grad = None
    model.lm_head.weight.grad = None
    chunked, n_chunked = causal_lm_loss(model.lm_head, hidden, labels, chunk_tokens=chunk_tokens)
    (chunked / n_chunked).backward()
    assert n_full.item() == n_chunked.item() == 3 * 20 - 4 - 3
    assert chunked.dtype == torch.float32
    assert abs(chunked.item() - full.item()) <= 1e-6 * abs(full.item())
    assert torch.allclose(hidden.grad, full_grads[0], rtol=0, atol=1e-6)
    assert torch.allclose(model.lm_head.weight.grad, full_grads[1], rtol=0, atol=1e-6), (
        (model.lm_head.weight.grad - full_grads[1]).abs().max()
    )


def test_chunked_loss_never_holds_more_than_one_chunk_of_logits():
    model = tiny_llama()
    ids = shakespeare_batches(1, micro_batch=2, seq_len=64)[0]
    logits_rows = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: logits_rows.append(out.shape[0]))
    saved_numel = []
    lm = TrainableLM(model, Precision(compute="fp32", loss_chunk_tokens=16))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved_numel.append(t.numel()) or t, lambda t: t):
        loss_sum, _ = lm(input_ids=ids, labels=ids)
    loss_sum.backward()
    # 2 x 63 = 126 target positions: 7 chunks of 16 and one of 14 in forward, each rebuilt once in backward.
    assert logits_rows[:8] == [16] * 7 + [14]
    assert sorted(logits_rows[8:]) == [14] + [16] * 7
    vocab = model.config.vocab_size
    assert max(saved_numel) < 16 * vocab  # nothing of logits size is kept for backward
    # The plain path keeps the full (tokens x vocab) logits for backward.
    full_saved = []
    plain = TrainableLM(tiny_llama(), Precision(compute="fp32", chunked_loss=False))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: full_saved.append(t.numel()) or t, lambda t: t):
        plain(input_ids=ids, labels=ids)
    assert max(full_saved) == 2 * 63 * vocab
