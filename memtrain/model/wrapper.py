"""The module handed to DeepSpeed: a causal LM that returns (loss sum, target token count)."""

from __future__ import annotations

import torch
from torch import nn

from memtrain.errors import Problem, UserError
from memtrain.labels import IGNORE_INDEX
from memtrain.model.architecture import logit_softcap
from memtrain.model.layers import hf_model
from memtrain.model.loss import causal_lm_loss, fused_causal_lm_loss
from memtrain.model.varlen import ATTN_NAME as VARLEN
from memtrain.model.varlen import packed_sequences
from memtrain.recipe.schema import Precision

# How each attention kernel keeps the samples of a packed row apart, given position_ids that restart at 0 for
# every sample (data/rows/row_set.py). "mask": with no attention_mask and no cache, transformers' create_causal_mask
# reads the restarts as sample boundaries and builds a block-diagonal causal mask (masking_utils.
# find_packed_sequence_indices, transformers 5.x). "flatten": flash attention reads the restarts only for a batch
# of one (modeling_flash_attention_utils._is_packed_sequence), so the rows go in end to end as one sequence and
# its variable-length kernel keeps every sample to itself. "cu_seqlens": PyTorch's variable-length flash kernel
# (model/varlen.py) takes the samples' bounds, built here once per forward from the restarts, and no mask.
PACKED_ATTENTION = {
    VARLEN: "cu_seqlens",
    "sdpa": "mask",
    "eager": "mask",
    "flex_attention": "mask",
    "flash_attention_2": "flatten",
    "flash_attention_3": "flatten",
}


def check_packed_attention(attn_implementation: str) -> None:
    """Raise UserError when the attention kernel would let packed samples attend to each other."""
    if attn_implementation not in PACKED_ATTENTION:
        raise UserError(
            Problem(
                f"attention {attn_implementation!r} cannot keep packed samples apart",
                key="model.attn_implementation",
                hint="set model.attn_implementation to auto, sdpa, varlen, eager or flash_attention_2, "
                "or data.packing: false",
            )
        )


class TrainableLM(nn.Module):
    """A Hugging Face causal LM (or its PEFT wrapper) whose forward returns
    (fp32 sum of token losses, number of target tokens) with the recipe's loss policy.

    The decoder body and the lm_head are called separately so the loss can be chunked; the
    lm_head module is called (never its weight) so ZeRO-3 gathers it in its own forward.
    `position_ids` (batch, seq) restarting at 0 mark the samples of packed rows (see PACKED_ATTENTION).
    fused_loss: Liger's fused linear cross-entropy instead of the chunked loss (memtrain.model.kernels.uses_fused_loss
    decides; it reads the head's weight, so never under ZeRO-3).
    """

    def __init__(self, model: nn.Module, precision: Precision, fused_loss: bool = False):
        super().__init__()
        self.model = model
        self.fused_loss = fused_loss
        self.fp32_loss = precision.fp32_loss
        self.chunk_tokens = precision.loss_chunk_tokens if precision.chunked_loss else None
        self.logit_softcap = logit_softcap(hf_model(model).config)  # Gemma-2 caps its logits; None for most models

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        base = hf_model(self.model)
        body = base.get_decoder()
        sequences = {}
        if position_ids is not None and attention_mask is None:
            attn = base.config._attn_implementation
            check_packed_attention(attn)
            if needs_one_sequence(attn, input_ids.shape[0]):
                input_ids, labels, position_ids = one_sequence(input_ids, labels, position_ids)
            sequences = sample_bounds(attn, position_ids)
        hidden = body(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **sequences
        ).last_hidden_state
        if self.fused_loss:
            return fused_causal_lm_loss(base.get_output_embeddings().weight, hidden, labels, softcap=self.logit_softcap)
        return causal_lm_loss(
            base.get_output_embeddings(),
            hidden,
            labels,
            fp32_loss=self.fp32_loss,
            chunk_tokens=self.chunk_tokens,
            softcap=self.logit_softcap,
        )


def sample_bounds(attn_implementation: str, position_ids: torch.Tensor) -> dict:
    """The decoder's extra kwargs for packed rows: the samples' bounds where the kernel takes them ("cu_seqlens"),
    none where transformers reads the position ids itself (PACKED_ATTENTION)."""
    return packed_sequences(position_ids) if PACKED_ATTENTION[attn_implementation] == "cu_seqlens" else {}


def needs_one_sequence(attn_implementation: str, batch_size: int) -> bool:
    """Whether rows with position_ids go to this attention kernel laid end to end (PACKED_ATTENTION "flatten")."""
    return PACKED_ATTENTION.get(attn_implementation) == "flatten" and batch_size > 1


def one_sequence(
    input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows laid end to end as a batch of one. Each row's first label becomes -100: laid end to end, the previous
    row's last token would otherwise predict it, a pair that does not exist row by row."""
    labels = labels.clone()
    labels[:, 0] = IGNORE_INDEX
    return input_ids.reshape(1, -1), labels.reshape(1, -1), position_ids.reshape(1, -1)
