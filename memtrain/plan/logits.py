"""Logits and loss: often the largest transient of a step (tokens × vocabulary, upcast to fp32).

The loss is traced under FakeTensorMode like the decoder layer: lm_head, the fp32 upcast and
cross-entropy over `tokens` rows, with saved-tensor hooks counting what backward keeps. Around that
the live tensors are priced explicitly, because they are not saved tensors: the logits themselves
and the upcast copy at the end of forward, and the two fp32 gradients (of the log-softmax output and
of its input) at the start of backward. A soft-capped head (Gemma-2: tanh(logits / cap) · cap, in the
loss dtype) keeps its tanh output for backward (traced) and, at the end of forward, the capped logits
beside the upcast; in backward the gradients through the cap replace each other (measured on the GPU:
Gemma-2-9B LoRA, one 1024-token chunk of a 256k vocabulary, 1.3 GiB above the uncapped loss's plan).

Liger's fused linear cross-entropy (`estimate_fused_logits`, model.kernels) is priced from its source
(liger_kernel/ops/fused_linear_cross_entropy.py, 0.8.5), not yet measured: it computes the gradients during
forward, so what it keeps for backward is the hidden states' gradient (and a trainable head's), and its
logits exist one chunk of about tokens × hidden / vocabulary rows at a time, in the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from memtrain.dtypes import DTYPES
from memtrain.model.loss import soft_cap


@dataclass(frozen=True)
class LogitsEstimate:
    tokens: int  # rows of logits alive at once (one chunk, or micro_batch × seq_len)
    saved_bytes: int  # kept by the loss for backward (log-softmax output)
    forward_bytes: int  # live at the end of the loss forward: logits + upcast + saved
    backward_bytes: int  # live at the start of its backward: saved + two gradients
    loss_tensor_bytes: int = 0  # one tokens × vocabulary tensor in the loss dtype (a gradient of the chunk)

    @property
    def peak_bytes(self) -> int:
        return max(self.forward_bytes, self.backward_bytes)


@lru_cache(maxsize=256)
def _saved_loss_bytes(
    hidden_size: int, vocab_size: int, compute: str, tokens: int, fp32_loss: bool, softcap: bool = False
) -> int:
    dtype = DTYPES[compute]
    saved: dict[int, int] = {}
    with FakeTensorMode():
        hidden = torch.empty(tokens, hidden_size, dtype=dtype, requires_grad=True)
        weight = torch.empty(vocab_size, hidden_size, dtype=dtype, requires_grad=True)
        labels = torch.zeros(tokens, dtype=torch.long)
        excluded = {hidden.untyped_storage()._cdata, weight.untyped_storage()._cdata}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage._cdata not in excluded and tensor.dtype.is_floating_point:
                saved[storage._cdata] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            logits = F.linear(hidden, weight)
            if fp32_loss:
                logits = logits.float()
            if softcap:
                logits = soft_cap(logits, 30.0)  # the cap's value changes no size
            F.cross_entropy(logits, labels)
    return sum(saved.values())


def estimate_logits(
    hidden_size: int,
    vocab_size: int,
    compute: str,
    micro_batch: int,
    seq_len: int,
    chunked: bool,
    chunk_tokens: int,
    fp32_loss: bool,
    softcap: bool = False,
) -> LogitsEstimate:
    """Bytes of the logits and loss at their peak, for the full sequence or one checkpointed chunk
    (softcap: the model soft-caps its output logits before the loss, as Gemma-2 does)."""
    tokens = micro_batch * seq_len
    if chunked:
        tokens = min(tokens, chunk_tokens)
    compute_bytes = DTYPES[compute].itemsize
    loss_bytes = 4 if fp32_loss else compute_bytes
    saved = _saved_loss_bytes(hidden_size, vocab_size, compute, tokens, fp32_loss, softcap)
    elements = tokens * vocab_size
    upcast = elements * loss_bytes if loss_bytes != compute_bytes else 0
    capped = elements * loss_bytes if softcap else 0
    forward = saved + elements * compute_bytes + upcast + capped
    backward = saved + 2 * elements * loss_bytes
    return LogitsEstimate(
        tokens=tokens,
        saved_bytes=saved,
        forward_bytes=forward,
        backward_bytes=backward,
        loss_tensor_bytes=elements * loss_bytes,
    )


def fused_chunk_tokens(tokens: int, hidden_size: int, vocab_size: int) -> int:
    """Rows of logits Liger's fused loss holds at once: its transient logits bounded to about tokens × hidden
    elements, the row count rounded up to a power of two (liger 0.8.5, chunk_mem_const 1)."""
    chunks = -(-vocab_size // hidden_size)
    rows = -(-tokens // chunks)
    return min(1 << (rows - 1).bit_length(), tokens)


def estimate_fused_logits(
    hidden_size: int, vocab_size: int, compute: str, micro_batch: int, seq_len: int, head_trainable: bool
) -> LogitsEstimate:
    """Bytes of Liger's fused linear cross-entropy at its peak (conservative until measured on the GPU).

    Kept for backward: the hidden states' gradient (tokens × hidden) and, for a trainable head, its weight's
    gradient (vocabulary × hidden), both in the compute dtype. The hidden states' gradient is counted on top of
    the head's output that `_head_bytes` already prices, though the fused loss frees that output: double
    counted on purpose, one tokens × hidden tensor, until a measurement says otherwise. During forward, beside
    them: one chunk of logits (overwritten by its own gradient), that chunk's hidden-state gradient before it
    is copied into place, the fp32 per-token losses and the shifted hidden states the loss was handed; with
    fp32 compute a head-sized fp32 product per chunk (its fallback path). Backward only scales the gradients
    in place, so it adds nothing to what forward kept.
    """
    compute_bytes = DTYPES[compute].itemsize
    tokens = micro_batch * seq_len
    chunk = fused_chunk_tokens(tokens, hidden_size, vocab_size)
    head_gradient = vocab_size * hidden_size * compute_bytes if head_trainable else 0
    saved = tokens * hidden_size * compute_bytes + head_gradient
    fp32_product = head_gradient if head_trainable and compute == "fp32" else 0
    forward = (
        saved
        + chunk * vocab_size * compute_bytes
        + chunk * hidden_size * compute_bytes
        + tokens * 4
        + tokens * hidden_size * compute_bytes
        + fp32_product
    )
    return LogitsEstimate(
        tokens=chunk,
        saved_bytes=saved,
        forward_bytes=forward,
        backward_bytes=saved,
        loss_tensor_bytes=chunk * vocab_size * compute_bytes,
    )
