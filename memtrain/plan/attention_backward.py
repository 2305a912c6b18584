"""What FlashAttention-2's backward allocates beside the layer's saved tensors, for one attention call.

The varlen kernel (PyTorch's own FlashAttention-2, `torch.nn.attention.varlen`) and SDPA's flash kernel keep only
q, k, v, out and a logsumexp for backward (the layer trace prices those), but their backward allocates, for the
whole call at once (PyTorch's flash_api.cpp, mha_varlen_bwd):
  dq, dk, dv        the gradients, the size of q, k and v;
  dk, dv expanded   with grouped-query attention, k's and v's gradients at the query's head count, summed after;
  dq_accum          fp32, (tokens + 128 per sequence) x heads x head_dim rounded up to 32 (64 past 128);
  softmax_d         fp32, heads x (tokens + 128 per sequence).
The 128 rows per sequence keep each sequence's atomic adds apart. They are what makes this grow with the number of
sequences in a packed micro-batch: 1,324 short conversations in one 32,768-token Qwen2.5-7B row add 2.3 GiB of
dq_accum, against 0.45 GiB for the tokens themselves (a memory trace on the GPU, benchmarks/segments/).
"""

from __future__ import annotations

import math

from transformers import PretrainedConfig

from memtrain.model.varlen import ATTN_NAME as VARLEN

# The kernels whose backward is FlashAttention-2's (SDPA picks its flash kernel on the GPU for causal bf16/fp16).
FLASH_KERNELS = (VARLEN, "flash_attention_2", "sdpa")
SEPARATION_ROWS = 128  # rows of dq_accum and softmax_d between two sequences (the kernel's largest block)
# Where the data is not counted (`memtrain plan` without --data), a packed row is priced as holding samples of this
# many tokens on average: conversations and documents are longer, a row of many short chats holds more.
ASSUMED_SAMPLE_TOKENS = 256


def flash_backward_bytes(config: PretrainedConfig, *, tokens: int, sequences: int, compute_bytes: int) -> int:
    """Bytes FlashAttention-2's backward allocates for one call over `tokens` tokens in `sequences` sequences."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rounded = _round_up(head_dim, 32 if head_dim <= 128 else 64)
    padded_rows = tokens + SEPARATION_ROWS * sequences
    gradients = tokens * (heads + 2 * kv_heads) * head_dim * compute_bytes
    expanded = 2 * tokens * heads * head_dim * compute_bytes if kv_heads != heads else 0
    accumulators = padded_rows * heads * (rounded + 1) * 4  # dq_accum and softmax_d, fp32
    return gradients + expanded + accumulators


def sequences_in_micro_batch(rows: int, seq_len: int, densest_row_samples: int | None, packed: bool) -> int:
    """How many sequences the kernel sees in a micro-batch of `rows` rows: one a row where rows are not packed,
    else the densest row's samples in each (counted from the data where given, else ASSUMED_SAMPLE_TOKENS)."""
    if not packed:
        return rows
    per_row = densest_row_samples or math.ceil(seq_len / ASSUMED_SAMPLE_TOKENS)
    return rows * max(1, per_row)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
