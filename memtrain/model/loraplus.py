"""LoRA+ as optimizer parameter groups: the adapters' B matrices learn faster than their A matrices.

LoRA+ (Hayou et al., 2024) shows that with one learning rate for both adapter matrices, B (the
up-projection, initialised at zero) learns too slowly for wide models; a larger rate for B, lr × ratio
with ratio around 16, converges faster at no memory cost. It is only a partition of the trainable
parameters by learning rate, so it is expressed as torch parameter groups that any optimizer takes —
torch's AdamW, DeepSpeed's CPU Adam, bitsandbytes' 8-bit AdamW — not as PEFT's
`create_loraplus_optimizer`, which builds the optimizer itself. A learning-rate schedule scales
each group's rate by the same factor, so the ratio holds through warmup and decay.
"""

from __future__ import annotations

from torch import nn

# PEFT's names for the up-projections of linear and embedding adapters ("...q_proj.lora_B.default.weight").
B_MATRIX_NAMES = ("lora_B", "lora_embedding_B")


def is_lora_b(parameter_name: str) -> bool:
    """Whether a parameter is a LoRA B matrix (the part LoRA+ trains at the higher rate)."""
    return any(part in B_MATRIX_NAMES for part in parameter_name.split("."))


def lora_param_groups(model: nn.Module, lr: float, ratio: float | None, weight_decay: float) -> list[dict]:
    """Torch parameter groups of the trainable parameters: B matrices at lr × ratio, the rest at lr.

    The rest is the A matrices, DoRA's magnitude vectors and any `modules_to_save`. Every group has
    the same weight decay (memtrain decays all trainable parameters alike). With ratio None, or a
    model without adapters, there is one group. Groups carry a "name" for logs; torch ignores it.
    """
    base, fast = [], []
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            (fast if ratio is not None and is_lora_b(name) else base).append(parameter)
    groups = [{"name": "base", "params": base, "lr": lr, "weight_decay": weight_decay}]
    if fast:
        groups.append({"name": "lora_B", "params": fast, "lr": lr * ratio, "weight_decay": weight_decay})
    return groups
