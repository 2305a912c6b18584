"""Architecture support is decided from the Hugging Face config, before anything is built."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from memtrain.errors import UserError
from memtrain.model.architecture import architecture
from memtrain.model.config import meta_model, model_config
from memtrain.model.layers import decoder_layer_names, decoder_layers
from memtrain.recipe.schema import Lora, Model
from tests.model.families import FAMILIES, tiny_config


def _refusal(config) -> str:
    with pytest.raises(UserError) as caught:
        architecture(config)
    (problem,) = caught.value.problems
    assert problem.key == "model.path" and problem.hint
    return problem.message + " — " + problem.hint


def test_an_encoder_only_model_is_refused_with_what_to_use_instead():
    text = _refusal(AutoConfig.for_model("bert", hidden_size=64, num_hidden_layers=2, num_attention_heads=4))
    assert "encoder-only" in text and "decoder-only causal LM" in text


def test_an_encoder_decoder_model_is_refused():
    text = _refusal(AutoConfig.for_model("t5", d_model=64, num_layers=2, num_heads=4))
    assert "encoder-decoder" in text and "Seq2SeqTrainer" in text


def test_a_vision_model_is_refused():
    text = _refusal(AutoConfig.for_model("vit", hidden_size=64, num_hidden_layers=2, num_attention_heads=4))
    assert "'vit' is a vision model" in text


def test_a_multimodal_model_is_refused_and_pointed_at_its_text_model():
    text = _refusal(AutoConfig.for_model("gemma3"))
    assert "multimodal" in text and "'gemma3_text'" in text


def test_a_multimodal_model_whose_text_model_has_no_causal_lm_class_is_not_pointed_at_it():
    """Qwen2-VL was pointed at 'qwen2_vl_text', which memtrain then refused (no AutoModelForCausalLM)."""
    text = _refusal(AutoConfig.for_model("qwen2_vl"))
    assert "multimodal" in text and "qwen2_vl_text" not in text and "text-only causal LM" in text


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_decoder_families_are_accepted_with_their_facts(family):
    arch = architecture(tiny_config(family))
    assert arch.num_layers == 2 and arch.vocab_size == tiny_config(family).vocab_size
    expected = {"gpt2": "GPT2LMHeadModel", "qwen2": "Qwen2ForCausalLM", "phi3": "Phi3ForCausalLM"}
    assert arch.causal_lm_class == expected.get(family, f"{family.capitalize()}ForCausalLM")
    assert arch.tied_embeddings == (family in ("gemma2", "gpt2"))


def test_gemma2_runs_eager_attention_and_says_why_once():
    arch = architecture(tiny_config("gemma2"), "sdpa")
    assert arch.attn_implementation == "eager"
    (note,) = arch.notes
    assert "soft-capped" in note and "flash_attention_2" in note
    # the built model gets the kernel the architecture chose, and sdpa-capable models keep sdpa
    assert model_config(Model(preset="gemma2-9b"))._attn_implementation == "eager"
    assert model_config(Model(preset="qwen2.5-7b"))._attn_implementation == "sdpa"
    assert architecture(tiny_config("llama"), "sdpa").notes == ()


def test_flash_attention_is_refused_where_the_class_has_none():
    config = AutoConfig.for_model("bloom", hidden_size=64, n_layer=2, n_head=4)
    with pytest.raises(UserError, match="no FlashAttention-2") as caught:
        architecture(config, "flash_attention_2")
    assert caught.value.problems[0].key == "model.attn_implementation"


def test_flash_attention_is_planned_without_flash_attn_and_refused_by_a_run_that_cannot_use_it():
    """plan builds the meta model and traces the layer without the flash-attn package (it traces sdpa's
    flash-style kernel, which keeps what flash-attn keeps); run refuses it up front where it cannot run."""
    from memtrain.model.architecture import check_attention_kernel
    from memtrain.plan.activations import trace_layer

    flash = Model(preset="tiny", attn_implementation="flash_attention_2")
    assert sum(p.numel() for p in meta_model(flash).parameters()) == sum(
        p.numel() for p in meta_model(Model(preset="tiny")).parameters()
    )
    flash_trace, sdpa_trace = trace_layer(flash, "bf16", 2, 64), trace_layer(Model(preset="tiny"), "bf16", 2, 64)
    assert flash_trace.saved_bytes() == sdpa_trace.saved_bytes() and flash_trace.saved_bytes()[0] > 0
    assert [(t.module, t.nbytes) for t in flash_trace.saved] == [(t.module, t.nbytes) for t in sdpa_trace.saved]
    for on_gpu, installed, says in ((False, True, "runs on CUDA GPUs"), (True, False, "needs the flash-attn package")):
        with pytest.raises(UserError, match=says) as caught:
            check_attention_kernel("flash_attention_2", on_gpu, installed)
        assert caught.value.problems[0].key == "model.attn_implementation" and "sdpa" in caught.value.problems[0].hint
    check_attention_kernel("flash_attention_2", on_gpu=True, flash_installed=True)
    check_attention_kernel("sdpa", on_gpu=False, flash_installed=False)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_layer_finder_finds_each_familys_decoder_layers(family):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(family))
    name, layers = decoder_layers(model)
    assert (name, len(layers)) == ({"gpt2": "transformer.h"}.get(family, "model.layers"), 2)


def test_the_layer_finder_sees_through_peft_and_prefers_declared_blocks_to_longer_lists():
    model = meta_model(Model(preset="micro", lora=Lora(r=2)))
    from memtrain.model.build import add_lora

    wrapped = add_lora(model, Model(preset="micro", lora=Lora(r=2)))
    assert decoder_layer_names(wrapped) == decoder_layer_names(model)
    assert decoder_layer_names(model)[0] == "model.layers.0"
    # A mixture-of-experts layer (transformers 4.x) holds its experts in a ModuleList longer than the layer list:
    # the declared decoder-layer class decides, not the length.
    layer_type = type(model.model.layers[0])
    model.model.layers[0].experts = nn.ModuleList(nn.Linear(2, 2, device="meta") for _ in range(60))
    assert len(model.model.layers) < 60 and layer_type.__name__ in model._no_split_modules
    assert decoder_layers(model)[0] == "model.layers"
