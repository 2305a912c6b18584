"""memtrain's chunked loss is the model's own loss, for every family, Gemma-2's logit soft-cap included."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from memtrain.model.architecture import architecture
from memtrain.model.wrapper import TrainableLM
from memtrain.recipe.schema import Precision
from tests.model.families import VOCAB, tiny_config

LOSS_FAMILIES = ["gemma2", "llama", "mistral", "phi3", "qwen2", "qwen3"]


def _tiny_model(family: str) -> torch.nn.Module:
    config = tiny_config(family)
    config._attn_implementation = architecture(config).attn_implementation
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        # logits of a few tens, so Gemma-2's cap of 30 bends them (at init they are ~0.1 and tanh is the identity)
        model.get_output_embeddings().weight.mul_(40.0)
    return model


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (2, 24), generator=generator)
    labels = input_ids.clone()
    labels[0, :5] = -100  # a masked prompt: ignored tokens must not count
    return input_ids, labels


@pytest.mark.parametrize("family", LOSS_FAMILIES)
def test_chunked_loss_equals_the_models_own_loss_in_fp32(family):
    model = _tiny_model(family)
    input_ids, labels = _batch()
    reference = model(input_ids=input_ids, labels=labels).loss  # HF shifts the labels itself
    lm = TrainableLM(model, Precision(compute="fp32", chunked_loss=True, loss_chunk_tokens=16))
    loss_sum, n_tokens = lm(input_ids, labels)
    assert n_tokens.item() == 2 * 23 - 4  # labels 1..4 of row 0 are masked; label 0 is never a target
    assert (loss_sum / n_tokens).item() == pytest.approx(reference.item(), abs=1e-5)
    assert lm.logit_softcap == (30.0 if family == "gemma2" else None)


def test_the_soft_cap_is_what_makes_gemma2_agree_and_its_gradients_match_too():
    model = _tiny_model("gemma2")
    input_ids, labels = _batch(seed=2)
    reference = model(input_ids=input_ids, labels=labels).loss
    reference.backward()
    head_grad = model.get_output_embeddings().weight.grad.clone()
    model.zero_grad()

    lm = TrainableLM(model, Precision(compute="fp32", chunked_loss=True, loss_chunk_tokens=16))
    loss_sum, n_tokens = lm(input_ids, labels)
    (loss_sum / n_tokens).backward()
    torch.testing.assert_close(model.get_output_embeddings().weight.grad, head_grad, rtol=1e-4, atol=1e-6)

    lm.logit_softcap = None  # what memtrain computed before: the uncapped logits
    with torch.no_grad():
        uncapped_sum, _ = lm(input_ids, labels)
    assert abs((uncapped_sum / n_tokens).item() - reference.item()) > 0.1
