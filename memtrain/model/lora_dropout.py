"""LoRA dropout that keeps the adapter input and a seed for backward, not the dropped input and its mask.

PEFT computes `lora_B(lora_A(dropout(x)))`: autograd then keeps, per adapted module, a new dropped copy
of x (lora_A's weight gradient needs it) and dropout's mask. Here `lora_A` computes
`dropout(x) @ A.T` itself and keeps x, which q/k/v (and gate/up) share, so one copy serves them all;
backward regenerates the mask from a seed. The seed comes from the CPU default generator, which
`torch.utils.checkpoint` restores before a recompute, so a recomputed layer draws the same masks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

_GENERATORS: dict[str, torch.Generator] = {}


def dropout_mask(
    shape: torch.Size, p: float, seed: int, device: torch.device, dtype: torch.dtype = torch.bool
) -> torch.Tensor:
    """The keep-mask (1 with probability 1 - p) that `seed` gives on `device`: the same on every call.

    One generator per device, re-seeded per call: creating a CUDA generator is a host cost paid twice
    per adapter per micro-batch otherwise."""
    generator = _GENERATORS.get(str(device))
    if generator is None:
        generator = _GENERATORS[str(device)] = torch.Generator(device=device)
    generator.manual_seed(seed)
    return torch.empty(shape, dtype=dtype, device=device).bernoulli_(1 - p, generator=generator)


@torch.compiler.disable
def draw_seed(x: torch.Tensor) -> int:
    """A seed from the CPU default generator: a host op, so no device sync.

    Run eager inside a compiled layer too: traced, the draw became a random op of the compiled graph, whose numbers
    are not the generator's sequence, so a compiled layer drew other masks than the eager one for the same seed.

    A fake tensor (the planner's trace) has no values, and `.item()` would fail under FakeTensorMode."""
    if isinstance(x, FakeTensor):
        return 0
    return int(torch.randint(2**62, (1,)).item())


def _matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype nn.Linear would multiply in: autocast's when it is on, else the input's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _drop(t: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    """t * keep * scale in one pass, rounded once: dropout's own backward kernel, which reads a bool
    mask as fast as a same-dtype one (a plain bf16 * bool product is ~3x slower on CUDA)."""
    return torch.ops.aten.native_dropout_backward(t, keep, scale)


class DropoutLinear(torch.autograd.Function):
    """h = dropout(x, p) @ A.T, saving (x, A) and the seed of the mask."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, p: float, seed: int) -> torch.Tensor:
        dtype = _matmul_dtype(x)
        ctx.x_dtype, ctx.weight_dtype, ctx.p, ctx.seed = x.dtype, weight.dtype, p, seed
        x, weight = x.to(dtype), weight.to(dtype)  # no-ops outside autocast; under it, what F.linear keeps
        ctx.save_for_backward(x, weight)
        return F.linear(_drop(x, dropout_mask(x.shape, p, seed, x.device), 1 / (1 - p)), weight)

    @staticmethod
    def backward(ctx, grad_h: torch.Tensor):
        x, weight = ctx.saved_tensors
        keep, scale = dropout_mask(x.shape, ctx.p, ctx.seed, x.device), 1 / (1 - ctx.p)
        grad_h = grad_h.to(x.dtype)
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_x = _drop(grad_h @ weight, keep, scale).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dropped = _drop(x, keep, scale).reshape(-1, x.shape[-1])
            grad_weight = (grad_h.reshape(-1, grad_h.shape[-1]).T @ dropped).to(ctx.weight_dtype)
        return grad_x, grad_weight, None, None


class LeanDropoutLinear(nn.Linear):
    """A LoRA A matrix that applies its adapter's dropout itself (through DropoutLinear) in training.

    Same parameters and state dict as the nn.Linear it replaces; in eval mode it is that nn.Linear."""

    p: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        return DropoutLinear.apply(x, self.weight, self.p, draw_seed(x))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, dropout={self.p}"


def use_lean_dropout(peft_model: nn.Module) -> int:
    """Move the dropout of every plain LoRA adapter with an nn.Dropout (p > 0) into its A matrix.

    Parameter names, the state dict and PEFT's adapter files are unchanged; variants that read the
    dropout module themselves (DoRA and others) keep PEFT's path. Returns how many adapters changed."""
    from peft.tuners.lora import LoraLayer

    changed = 0
    for module in peft_model.modules():
        if not isinstance(module, LoraLayer):
            continue
        for adapter, dropout in list(module.lora_dropout.items()):
            lora_a = module.lora_A[adapter] if adapter in module.lora_A else None
            plain = adapter not in getattr(module, "lora_variant", {})
            if not (isinstance(dropout, nn.Dropout) and dropout.p > 0 and type(lora_a) is nn.Linear and plain):
                continue
            lora_a.__class__ = LeanDropoutLinear
            lora_a.p = dropout.p
            module.lora_dropout[adapter] = nn.Identity()
            changed += 1
    return changed
