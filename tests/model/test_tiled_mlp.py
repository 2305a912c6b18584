"""checkpointing.mlp_tiles: the tiled MLP gives the untiled loss and every gradient, keeps only its input."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from memtrain.errors import UserError
from memtrain.model.recompute import apply_checkpointing
from memtrain.model.tiled_mlp import apply_mlp_tiles, tile_count
from memtrain.model.wrapper import TrainableLM
from memtrain.recipe.schema import Checkpointing, Precision
from tests.model.families import tiny_config
from tests.model.test_support import one_torch_thread, shakespeare_batches  # noqa: F401 (autouse fixture)

FP32 = Precision(compute="fp32", chunked_loss=True, loss_chunk_tokens=16)
FAMILIES = ("llama", "qwen2", "phi3", "gemma2")  # Phi-3: one fused gate_up_proj; Gemma-2: GEGLU


def tiny(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_config(family)
    config._attn_implementation = "eager" if family == "gemma2" else "sdpa"  # Gemma-2 has no sdpa path
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    return model


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    torch.manual_seed(1)  # the same adapters in every copy
    peft = get_peft_model(model, config)
    for name, param in peft.named_parameters():  # B starts at zero: give the adapters a gradient through every path
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    peft.enable_input_require_grads()
    return peft


def loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    loss_sum, n_tokens = TrainableLM(model, FP32)(input_ids=ids, labels=ids)
    loss = loss_sum / n_tokens
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_same(reference, tiled):
    (ref_loss, ref_grads), (loss, grads) = reference, tiled
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    assert ref_grads.keys() == grads.keys()
    for name, grad in ref_grads.items():
        assert grad.abs().sum() > 0, name  # a gradient that flows at all
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=0, msg=name)


# 29 tokens in 4 tiles: the last tile is shorter; micro-batch 3
CASES = {"divisible": (2, 32, 4), "ragged": (3, 29, 4), "auto_tiles": (2, 32, "auto")}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", FAMILIES)
def test_tiles_keep_loss_and_every_gradient(family, case, lora):
    micro_batch, seq_len, tiles = CASES[case]
    ids = shakespeare_batches(1, micro_batch=micro_batch, seq_len=seq_len)[0]
    base = tiny(family)
    reference_model = with_lora(copy.deepcopy(base)) if lora else copy.deepcopy(base)
    tiled_model = with_lora(copy.deepcopy(base)) if lora else copy.deepcopy(base)
    assert apply_mlp_tiles(tiled_model, Checkpointing(strategy="none", mlp_tiles=tiles)) == 2
    assert_same(loss_and_grads(reference_model, ids), loss_and_grads(tiled_model, ids))


@pytest.mark.parametrize("on_host", [True, False], ids=["inputs-on-host", "transformers-checkpointing"])
def test_tiles_inside_recomputed_layers(on_host):
    """The shipped long recipe's combination (whole layers recomputed, inputs on the host, MLPs tiled), and whole
    layers handed to transformers' own checkpointing."""
    ids = shakespeare_batches(1, micro_batch=2, seq_len=31)[0]
    base = tiny("qwen2")
    model = with_lora(copy.deepcopy(base))
    reference = loss_and_grads(with_lora(copy.deepcopy(base)), ids)
    config = Checkpointing(strategy="every_layer", offload_inputs=on_host, mlp_tiles=3)
    plan = apply_checkpointing(model, config)
    assert apply_mlp_tiles(model, config) == 2
    assert_same(reference, loss_and_grads(model, ids))
    assert (plan.offload_stats.packed_tensors > 0) == on_host


def test_forward_keeps_only_the_mlp_input():
    """What autograd keeps from a tiled MLP is its input: none of the (tokens x intermediate) tensors."""
    model = tiny("llama")
    apply_mlp_tiles(model, Checkpointing(strategy="none", mlp_tiles=4))
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 32, 64, requires_grad=True)
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.shape) or t, lambda t: t):
        mlp(x)
    assert sizes == [x.shape]
    mlp.eval()  # evaluation runs the plain forward
    sizes.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.shape) or t, lambda t: t):
        mlp(x)
    assert torch.Size([2, 32, 128]) in sizes


@pytest.mark.parametrize("family", FAMILIES)
def test_without_grad_the_mlp_runs_tile_by_tile_to_the_untiled_output(family):
    """Validation (no grad) at a long sequence: each tile's intermediates alone, the same output."""
    model = tiny(family)
    untiled = copy.deepcopy(model.model.layers[0].mlp).eval()
    apply_mlp_tiles(model, Checkpointing(strategy="none", mlp_tiles=4))
    mlp = model.model.layers[0].mlp.eval()
    widths = []
    first = next(m for m in mlp.modules() if isinstance(m, torch.nn.Linear))
    first.register_forward_hook(lambda _m, inputs, _out: widths.append(inputs[0].shape[-2]))
    x = torch.randn(2, 30, 64)
    with torch.no_grad():
        tiled_out = mlp(x)
        torch.testing.assert_close(tiled_out, untiled(x), atol=1e-6, rtol=0)
        assert widths == [8, 8, 7, 7]  # four tiles of the 30 tokens, none of them whole
        widths.clear()
        mlp(x[:, :1])  # one token (a generation step): untiled
    assert widths == [1]


def test_tile_count():
    assert tile_count("auto", 32_768, 3_584) == 10  # Qwen2.5-7B at 32k: ceil(32768 / 3584)
    assert tile_count("auto", 4_096, 4_096) == 0  # one tile: untiled
    assert tile_count(0, 65_536, 4_096) == 0
    assert tile_count(8, 5, 64) == 5  # never more tiles than tokens
    assert tile_count(1, 100, 64) == 0


def test_a_layer_without_an_mlp_is_refused():
    model = tiny("llama")
    del model.model.layers[1].mlp
    with pytest.raises(UserError) as error:
        apply_mlp_tiles(model, Checkpointing(strategy="none", mlp_tiles=2))
    assert error.value.problems[0].key == "checkpointing.mlp_tiles"
    assert "layer 1" in error.value.problems[0].message
