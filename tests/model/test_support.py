"""Shared pieces for the memory-policy tests: a tiny Llama from a config and real Shakespeare batches."""

from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from memtrain.data.read.corpus import read_documents

TOKENIZER = Path(__file__).resolve().parents[2] / "memtrain/assets/tokenizer/shakespeare/tokenizer.json"
SEQ_LEN = 32
MICRO_BATCH = 2


def tiny_config(layers: int = 4) -> LlamaConfig:
    """A Llama small enough for 30 CPU steps in about a second, with the bundled tokenizer's vocabulary."""
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4096,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    return config


@lru_cache(maxsize=None)
def _base_model(layers: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config(layers))


def tiny_llama(layers: int = 4, seed: int = 0) -> LlamaForCausalLM:
    """A fresh copy of the same randomly initialised tiny Llama (fp32, training mode)."""
    model = copy.deepcopy(_base_model(layers, seed))
    model.train()
    return model


@lru_cache(maxsize=None)
def _token_stream(n_tokens: int) -> torch.Tensor:
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER))
    ids: list[int] = []
    for doc in read_documents("builtin:shakespeare"):
        ids.extend(tokenizer(doc)["input_ids"])
        if len(ids) >= n_tokens:
            break
    return torch.tensor(ids[:n_tokens])


def shakespeare_batches(steps: int, micro_batch: int = MICRO_BATCH, seq_len: int = SEQ_LEN) -> list[torch.Tensor]:
    """`steps` batches of (micro_batch, seq_len) token ids cut from the bundled corpus, in order."""
    stream = _token_stream(steps * micro_batch * seq_len)
    return list(stream.view(steps, micro_batch, seq_len))


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny models run ~20x faster on one thread than on two contended cores (the CI machine is shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
