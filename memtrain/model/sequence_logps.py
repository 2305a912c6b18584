"""Per-sequence log-probabilities of a causal LM's targets, computed a chunk of tokens at a time.

A preference loss needs, for every row, the summed log-probability of its target tokens (and how many there are),
not a mean over the batch's tokens. The per-token log-probabilities are small (rows × width fp32); the
full-vocabulary logits are not, so they are built a chunk of tokens at a time under non-reentrant checkpointing,
as model/loss.py's causal_lm_loss does: forward keeps each chunk's hidden states, backward rebuilds one chunk's
logits. The same policy: logits upcast to fp32 when precision.fp32_loss, the model's soft-cap applied per chunk, and
the lm_head *module* called (never its weight) so ZeRO-3 gathers it in its own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from memtrain.labels import IGNORE_INDEX
from memtrain.model.loss import soft_cap


def _chunk_token_logps(
    lm_head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, fp32_loss: bool, softcap: float | None
) -> torch.Tensor:
    logits = lm_head(hidden)
    if fp32_loss:
        logits = logits.float()
    if softcap is not None:  # after the upcast, so the fp32 path also gets an fp32 tanh
        logits = soft_cap(logits, softcap)
    # cross_entropy with reduction "none" is -log p(target) per token and exactly 0 at the ignore label
    return -F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="none").float()


def token_logps(
    lm_head: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    *,
    fp32_loss: bool = True,
    chunk_tokens: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """fp32 (rows, seq - 1): log p(labels[:, t + 1]) from hidden[:, t]; 0 where that label is -100.

    hidden: (rows, seq, hidden) final hidden states; labels: (rows, seq), label t being the token at t.
    chunk_tokens: tokens per chunk, None for the whole batch's logits at once.
    """
    rows, seq = labels.shape
    flat_hidden = hidden[:, :-1, :].reshape(-1, hidden.shape[-1])
    targets = labels[:, 1:].reshape(-1)
    if chunk_tokens is None or flat_hidden.shape[0] <= chunk_tokens:
        return _chunk_token_logps(lm_head, flat_hidden, targets, fp32_loss, softcap).view(rows, seq - 1)
    parts = []
    for start in range(0, flat_hidden.shape[0], chunk_tokens):
        part = slice(start, start + chunk_tokens)
        if torch.is_grad_enabled():
            parts.append(
                checkpoint(
                    _chunk_token_logps,
                    lm_head,
                    flat_hidden[part],
                    targets[part],
                    fp32_loss,
                    softcap,
                    use_reentrant=False,
                )
            )
        else:
            parts.append(_chunk_token_logps(lm_head, flat_hidden[part], targets[part], fp32_loss, softcap))
    return torch.cat(parts).view(rows, seq - 1)


def target_mask(labels: torch.Tensor) -> torch.Tensor:
    """(rows, seq - 1) bool: which shifted positions predict a target (the label at t + 1 is not -100)."""
    return labels[:, 1:] != IGNORE_INDEX


def sequence_logps(per_token: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the per-token log-probs over `mask` per row, count of masked tokens per row as fp32)."""
    mask_f = mask.to(per_token.dtype)
    return (per_token * mask_f).sum(-1), mask_f.sum(-1)


def segment_logps(
    per_token: torch.Tensor, mask: torch.Tensor, sequence_ids: torch.Tensor, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sequence_logps` for rows that hold several sequences end to end (pairs laid out packed, data/rows/pairs.py):
    per_token and mask (rows, seq - 1) as there, sequence_ids (rows, seq) each position's sequence (-1: padding);
    returns (count,) sums and counts. A shifted position's target is the token after it, so it belongs to that
    token's sequence."""
    targets = sequence_ids[:, 1:]
    keep = mask & (targets >= 0)
    index = targets[keep]
    values = per_token[keep]
    sums = per_token.new_zeros(count).index_add(0, index, values)
    counts = per_token.new_zeros(count).index_add(0, index, torch.ones_like(values))
    return sums, counts
