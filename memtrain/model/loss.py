"""Causal-LM loss as (sum of token losses, number of target tokens), optionally in chunks.

The chunked path never holds the full-vocabulary logits: each chunk of tokens goes through the
lm_head module and cross-entropy under non-reentrant checkpointing, so forward keeps only the
chunk's hidden states and backward rebuilds one chunk's logits at a time. The lm_head *module* is
called per chunk (never its .weight) so ZeRO-3 gathers the weight inside its own forward.

Logit soft-capping (Gemma-2's `final_logit_softcapping`) belongs to the model's function, not to the
loss: its forward squashes the logits to tanh(logits / cap) · cap after the lm_head. Calling the
lm_head here bypasses that forward, so the cap is applied here, per chunk, before the cross-entropy.

With Liger's kernels (`model.kernels`, memtrain.model.kernels.uses_fused_loss) the loss may instead be
Liger's fused linear cross-entropy: it takes the hidden states and the head's *weight*, computes the
logits a chunk at a time, and writes the gradients of the hidden states (and of a trainable head) during
forward, so backward only scales them. Same contract: reduction "sum" over the targets that are not -100
(the loop divides by the global batch's target count, memtrain.train.step.micro_batches), the soft-cap applied inside
the kernel before the softmax, which is always computed in fp32. The head's gradient is summed over the
chunks in the weight's dtype, as autograd sums the chunked loss's chunks.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from memtrain.labels import IGNORE_INDEX


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """tanh(logits / cap) · cap: smooth, monotonic, bounded to (-cap, cap), near identity for |logits| << cap."""
    return torch.tanh(logits / cap) * cap


def _token_loss_sum(
    lm_head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, fp32_loss: bool, softcap: float | None = None
) -> torch.Tensor:
    logits = lm_head(hidden)
    if fp32_loss:
        logits = logits.float()
    if softcap is not None:  # after the upcast, so the fp32 loss also gets an fp32 tanh
        logits = soft_cap(logits, softcap)
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum").float()


def shift_for_next_token(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states (tokens, hidden) and targets (tokens,) aligned so position t predicts label t+1."""
    return hidden[:, :-1, :].reshape(-1, hidden.shape[-1]), labels[:, 1:].reshape(-1)


def causal_lm_loss(
    lm_head: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    *,
    fp32_loss: bool = True,
    chunk_tokens: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 sum of next-token cross-entropies, count of target tokens); labels equal to -100 are ignored.

    hidden: (batch, seq, hidden) final hidden states; labels: (batch, seq) token ids.
    chunk_tokens: tokens per chunk of the chunked loss, None for full logits at once.
    softcap: the model's output-logit soft-cap (memtrain.model.architecture.logit_softcap), None for none.
    """
    flat_hidden, targets = shift_for_next_token(hidden, labels)
    n_tokens = (targets != IGNORE_INDEX).sum()
    if chunk_tokens is None or flat_hidden.shape[0] <= chunk_tokens:
        return _token_loss_sum(lm_head, flat_hidden, targets, fp32_loss, softcap), n_tokens
    total = flat_hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, flat_hidden.shape[0], chunk_tokens):
        part = slice(start, start + chunk_tokens)
        if torch.is_grad_enabled():
            total = total + checkpoint(
                _token_loss_sum, lm_head, flat_hidden[part], targets[part], fp32_loss, softcap, use_reentrant=False
            )
        else:
            total = total + _token_loss_sum(lm_head, flat_hidden[part], targets[part], fp32_loss, softcap)
    return total, n_tokens


def fused_causal_lm_loss(
    head_weight: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor, *, softcap: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """causal_lm_loss through Liger's fused linear cross-entropy (CUDA only; liger-kernel must be installed).

    head_weight: the output head's weight (vocabulary, hidden), in the hidden states' dtype.
    """
    flat_hidden, targets = shift_for_next_token(hidden, labels)
    n_tokens = (targets != IGNORE_INDEX).sum()
    liger = importlib.import_module("liger_kernel.transformers")  # optional dependency (memtrain[liger])
    loss = liger.LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum", softcap=softcap)
    return loss(head_weight, flat_hidden.contiguous(), targets.contiguous()).float(), n_tokens
