"""Tiny configs of the model families memtrain supports (hidden 64, 2 layers, the bundled tokenizer's vocabulary)."""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

VOCAB = 4096  # the bundled Shakespeare tokenizer

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
)

# Each family's distinguishing fields, at tiny size: the same model_type as the 7B-class presets.
FAMILIES: dict[str, dict] = {
    "llama": dict(tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=False),
    "qwen3": dict(head_dim=16, tie_word_embeddings=False),
    "mistral": dict(head_dim=16, sliding_window=None, tie_word_embeddings=False),
    "gemma2": dict(
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=8,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
    ),
    "phi3": dict(
        num_key_value_heads=4, sliding_window=2047, tie_word_embeddings=False, pad_token_id=0, eos_token_id=0
    ),  # its defaults (32000) lie beyond a tiny vocabulary
    "gpt2": dict(),
}


def tiny_config(family: str, **overrides) -> PretrainedConfig:
    """A tiny PretrainedConfig of `family` (its model_type), with `overrides` applied."""
    if family == "gpt2":
        fields = dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
    else:
        fields = {**_COMMON, **FAMILIES[family]}
    return AutoConfig.for_model(family, **{**fields, **overrides})
