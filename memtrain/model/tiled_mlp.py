"""`checkpointing.mlp_tiles`: every decoder layer's MLP computed in tiles along the sequence.

DeepSpeed's TiledMLP (deepspeed.runtime.sequence_parallel.ulysses_sp, an autograd function) runs the MLP tile
by tile without grad in forward and keeps only its input; backward recomputes each tile with grad and
accumulates the weight gradients, so the MLP's intermediates (gate, up, the activation's output and their
gradients: seq_len x intermediate_size each) exist for one tile at a time. It marks the trainable parameters
`ds_grad_is_ready` only at the last tile, so ZeRO 1/2/3 reduce each gradient once, after its last addition.

What is written here is the glue: the MLP module instance's own forward is wrapped (inside its __call__, so
ZeRO-3's gathering hooks stay around it), whatever it computes: Llama's, Qwen's and Mistral's SwiGLU, Phi-3's
fused gate_up_proj, Gemma-2's GEGLU, LoRA-wrapped projections or Liger's SwiGLU module. The wrapped forward is
called once per tile with a (micro_batch, tile, hidden) slice; an MLP is per token, so the tiles' outputs are
the untiled output.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from memtrain.errors import Problem, UserError
from memtrain.model.layers import decoder_layers
from memtrain.recipe.schema import Checkpointing

# the decoder layer's child that holds its MLP in the transformers families memtrain trains (model.layers.N.mlp)
MLP_NAME = "mlp"


def tile_count(tiles: int | str, seq_len: int, hidden_size: int) -> int:
    """How many tiles `checkpointing.mlp_tiles` gives at this sequence length: 'auto' takes DeepSpeed's own rule,
    one tile per hidden_size tokens (a tile's intermediate is then about one MLP weight matrix in size); 0 or 1
    (auto on a sequence no longer than hidden_size) means untiled. Never more tiles than tokens."""
    count = math.ceil(seq_len / hidden_size) if tiles == "auto" else int(tiles)
    return min(count, seq_len) if count > 1 else 0


def tiles_on(checkpointing: Checkpointing) -> bool:
    """Whether the recipe asks for tiled MLPs at all (0 is off)."""
    return checkpointing.mlp_tiles != 0


def apply_mlp_tiles(model: nn.Module, checkpointing: Checkpointing) -> int:
    """Wrap every decoder layer's MLP forward in DeepSpeed's TiledMLP (in place; call before deepspeed.initialize,
    with or without PEFT's wrapper around the model). Returns how many MLPs were wrapped (0 when mlp_tiles is 0).

    Raises UserError (key checkpointing.mlp_tiles) when a decoder layer has no `mlp` child."""
    if not tiles_on(checkpointing):
        return 0
    _, layers = decoder_layers(model)
    missing = [i for i, layer in enumerate(layers) if not isinstance(getattr(layer, MLP_NAME, None), nn.Module)]
    if missing:
        children = ", ".join(name for name, _ in layers[missing[0]].named_children())
        raise UserError(
            Problem(
                f"checkpointing.mlp_tiles tiles each decoder layer's '{MLP_NAME}' module; layer {missing[0]} of "
                f"{type(layers[missing[0]]).__name__} has none (its children: {children})",
                key="checkpointing.mlp_tiles",
                hint="set checkpointing.mlp_tiles=0 for this model",
            )
        )
    hidden_size = getattr(getattr(model, "config", None), "hidden_size", None)
    for layer in layers:
        _wrap(getattr(layer, MLP_NAME), checkpointing.mlp_tiles, hidden_size)
    return len(layers)


def _wrap(mlp: nn.Module, tiles: int | str, hidden_size: int | None) -> None:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP  # noqa: PLC0415 — heavy; only tiled runs

    original = mlp.forward

    def per_tile(_module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return original(x)

    @functools.wraps(original)
    def forward(hidden_states: torch.Tensor, *args, **kwargs):
        if args or kwargs or hidden_states.dim() < 2:
            return original(hidden_states, *args, **kwargs)
        count = tile_count(tiles, hidden_states.shape[-2], hidden_size or hidden_states.shape[-1])
        if count == 0:
            return original(hidden_states)
        if not torch.is_grad_enabled():
            # validation and a long prompt's prefill: nothing is kept for backward, but an untiled MLP still
            # holds the whole sequence's intermediates at once; at 32k tokens that outgrew the training peak
            return torch.cat([original(part) for part in torch.tensor_split(hidden_states, count, dim=-2)], dim=-2)
        if not mlp.training:
            return original(hidden_states)
        # read at each call: the trainable parameters are known only after PEFT and the recipe's freezing
        trainable = [p for p in mlp.parameters() if p.requires_grad]
        return TiledMLP.apply(per_tile, mlp, hidden_states, count, trainable)

    mlp.forward = forward
