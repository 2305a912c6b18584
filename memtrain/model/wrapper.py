"""The module handed to DeepSpeed: a causal LM that returns (loss sum, target token count)."""
from __future__ import annotations

import torch
from torch import nn

from memtrain.model.architecture import logit_softcap
from memtrain.model.layers import hf_model
from memtrain.model.loss import causal_lm_loss
from memtrain.recipe.schema import Precision


class TrainableLM(nn.Module):
    """A Hugging Face causal LM (or its PEFT wrapper) whose forward returns
    (fp32 sum of token losses, number of target tokens) with the recipe's loss policy.

    The decoder body and the lm_head are called separately so the loss can be chunked; the
    lm_head module is called (never its weight) so ZeRO-3 gathers it in its own forward.
    """

    def __init__(self, model: nn.Module, precision: Precision):
        super().__init__()
        self.model = model
        self.fp32_loss = precision.fp32_loss
        self.chunk_tokens = precision.loss_chunk_tokens if precision.chunked_loss else None
        self.logit_softcap = logit_softcap(hf_model(model).config)  # Gemma-2 caps its logits; None for most models

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        base = hf_model(self.model)
        body = base.get_decoder()
        hidden = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return causal_lm_loss(base.get_output_embeddings(), hidden, labels,
                              fp32_loss=self.fp32_loss, chunk_tokens=self.chunk_tokens,
                              softcap=self.logit_softcap)
