"""Packed rows through PyTorch's own variable-length flash attention (`torch.nn.attention.varlen.varlen_attn`).

A packed row holds several samples whose position ids restart at 0 (data/rows/row_set.py). Under sdpa, transformers
keeps them apart with a dense (batch, 1, seq, seq) block-diagonal mask, which rules out PyTorch's flash kernel and
costs seq² bytes per row. This kernel instead takes the rows laid end to end with the cumulative sample lengths
(`cu_seqlens`) and a bound on the longest sample (`max_seqlen`), built once per forward from the position-id restarts
(`packed_sequences`), and never builds a mask.

It is registered in transformers' attention interface under ATTN_NAME (the model is built with it); its mask
function gives no mask when the rows come without a padding mask, and sdpa's otherwise. Called with the sequence
kwargs (`cu_seq_lens_q`, ...: transformers' own names for flash attention, which its models pass down to every
attention call) it runs varlen_attn; called without them (generation, rows without position ids) it is sdpa.

varlen_attn runs PyTorch's FlashAttention-2 kernel: a CUDA GPU of compute capability 8.0 or newer (Ampere, Ada,
Hopper: RTX 3090 / 4090, A100, H100), fp16 or bf16 tensors. PyTorch 2.11's signature is the common ground kept
here: (q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, scale=, window_size=); causal is window_size (-1, 0). Its
kernel takes fewer key/value heads than query heads (grouped-query attention) as flash-attn does; later
releases ask for `enable_gqa=True` to say so, passed only where the signature has it. Soft-capped attention
scores (Gemma-2) are not supported by it: such models keep eager attention (memtrain.model.architecture).
"""

from __future__ import annotations

import inspect

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_NAME = "memtrain_varlen"  # the name in transformers' attention interface (config._attn_implementation)
# Compute capability the kernel needs: PyTorch builds FlashAttention-2 for sm80 and newer
# (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, check_flash_attention_hardware_support).
MIN_CAPABILITY = (8, 0)
HALF_DTYPES = (torch.float16, torch.bfloat16)


def _varlen_attn():
    """torch.nn.attention.varlen.varlen_attn, or None in a PyTorch without it (before 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: PLC0415 — absent from older PyTorch
    except ImportError:
        return None
    return varlen_attn


VARLEN_ATTN = _varlen_attn()
_GQA_FLAG = VARLEN_ATTN is not None and "enable_gqa" in inspect.signature(VARLEN_ATTN).parameters


def varlen_available(device: torch.device | None = None) -> bool:
    """Whether this PyTorch has varlen_attn and the CUDA device (the current one by default) can run it."""
    if VARLEN_ATTN is None or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def packed_sequences(position_ids: torch.Tensor) -> dict[str, torch.Tensor | int]:
    """The sequence kwargs of rows (batch, seq) laid end to end: every position id 0 starts a sample.

    cu_seq_lens_q / _k: int32 (samples + 1,) cumulative lengths, from 0 to batch × seq, on position_ids' device;
    max_length_q / _k: the row width, as a Python int: the kernel sizes its launch grid by it, and no sample is longer
    (every row starts one). The longest sample itself changes from batch to batch, and a compiled layer guards on
    the value: on the H100 the first change cost a recompile of 4 s in the fourth step of a chat run; blocks of
    the grid past a sample's end return at once. Built on the host from one
    copy of the position ids (one device sync per forward, not one per layer as transformers' own derivation).
    Padding continues the last sample's positions, so it is counted into that sample: real tokens never attend to
    the padding after them under the causal mask, and the loss ignores the padding's outputs.
    """
    flat = position_ids.reshape(-1).cpu()
    starts = torch.nonzero(flat == 0).reshape(-1).to(torch.int32)
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("packed rows must start with position id 0 (every row starts a sample)")
    cu_seqlens = torch.cat((starts, torch.tensor([flat.numel()], dtype=torch.int32)))
    cu_seqlens = cu_seqlens.to(position_ids.device, non_blocking=True)
    # compiled layers take the number of samples as a size from the first call on, not after a recompile
    torch._dynamo.maybe_mark_dynamic(cu_seqlens, 0)
    row_width = position_ids.shape[-1]
    return {
        "cu_seq_lens_q": cu_seqlens,
        "cu_seq_lens_k": cu_seqlens,
        "max_length_q": row_width,
        "max_length_k": row_width,
    }


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function: query (batch, heads, seq, dim), key / value (batch, kv_heads, seq, dim)
    in, (batch, seq, heads, dim) out. With the sequence kwargs (`packed_sequences`) every row's samples attend
    causally to themselves alone; without them it is sdpa."""
    if "cu_seq_lens_q" not in kwargs and _rows_with_positions(query, key, attention_mask, kwargs.get("position_ids")):
        # a caller that gave position ids but not the sequences (the decoder called directly): derived here, at one
        # device sync per layer instead of one per forward
        kwargs.update(packed_sequences(kwargs["position_ids"].expand(query.shape[0], -1)))  # (1, seq) is shared
    cu_seqlens = kwargs.pop("cu_seq_lens_q", None)
    if cu_seqlens is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if softcap is not None:
        raise ValueError("varlen attention does not soft-cap attention scores; this model needs eager attention")
    if dropout:
        raise ValueError(f"varlen attention has no attention dropout (the model asks for {dropout})")
    batch, heads, seq, head_dim = query.shape
    out_dtype = query.dtype
    dtype = query.dtype
    if query.is_cuda and dtype not in HALF_DTYPES:
        # autocast leaves fp32 queries where RoPE upcasts them; the flash kernel takes fp16 / bf16 only
        if not torch.is_autocast_enabled(query.device.type):
            raise ValueError(f"varlen attention needs fp16 or bf16 tensors, got {dtype}")
        dtype = torch.get_autocast_dtype(query.device.type)

    def flat(t: torch.Tensor) -> torch.Tensor:  # (batch, heads, seq, dim) -> (batch * seq, heads, dim)
        return t.transpose(1, 2).reshape(batch * seq, t.shape[1], head_dim).to(dtype)

    options = {}
    if _GQA_FLAG and key.shape[1] != heads:
        options["enable_gqa"] = True
    window = (-1, 0) if not sliding_window else (sliding_window - 1, 0)
    if not query.is_cuda:  # the kernel is CUDA's alone: the same function, one sample at a time (CPU tests)
        out = attend_by_sample(flat(query), flat(key), flat(value), cu_seqlens, scale=scaling, window_size=window)
        return out.reshape(batch, seq, heads, head_dim).to(out_dtype), None
    out = VARLEN_ATTN(
        flat(query),
        flat(key),
        flat(value),
        cu_seqlens,
        kwargs.get("cu_seq_lens_k", cu_seqlens),
        kwargs["max_length_q"],
        kwargs.get("max_length_k", kwargs["max_length_q"]),
        scale=scaling,
        window_size=window,
        **options,
    )
    return out.reshape(batch, seq, heads, head_dim).to(out_dtype), None


def _rows_with_positions(query, key, attention_mask, position_ids) -> bool:
    """Whole rows (no cache, no padding mask) whose position ids each start at 0: rows packed_sequences reads."""
    return (
        attention_mask is None
        and position_ids is not None
        and query.shape[2] == key.shape[2] > 1
        and bool((position_ids[:, 0] == 0).all())
    )


def attend_by_sample(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, 0),
) -> torch.Tensor:
    """What varlen_attn computes, (tokens, heads, dim) in and out, with causal sdpa over each sample alone: where the
    kernel cannot run (a device without it) and as its reference. window_size as varlen_attn's: (-1, 0) causal,
    (W - 1, 0) causal within a window of W tokens."""
    bounds = cu_seqlens.tolist()
    pieces = []
    for begin, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = (t[begin:end].transpose(0, 1) for t in (query, key, value))  # (heads, length, dim)
        mask = None
        if window_size[0] >= 0:  # causal and at most window_size[0] tokens back
            at = torch.arange(end - begin, device=query.device)
            mask = (at[None, :] <= at[:, None]) & (at[:, None] - at[None, :] <= window_size[0])
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=k.shape[0] != q.shape[0]
        )
        pieces.append(out.transpose(0, 1))
    return torch.cat(pieces)


def varlen_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    """The mask transformers builds for this kernel: none for rows without a padding mask (packed rows: the
    samples' bounds travel as cu_seqlens; plain rows: causal in the kernel), sdpa's where a padding mask is
    given (generation, which runs the sdpa path)."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(ATTN_NAME, varlen_attention_forward)
AttentionMaskInterface.register(ATTN_NAME, varlen_mask)
