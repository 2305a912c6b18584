"""The optimizer step fused into the backward pass (`optimizer.step_in_backward`), as torchtune does it.

Each trainable parameter gets its own optimizer (torch's AdamW or a bitsandbytes one), stepped by a
hook the moment autograd has finished that parameter's gradient; the gradient is freed right after.
A full fine-tune then never holds the whole model's gradients — for a 7B model, 12.5 GiB of bf16
gradients that never exist — and with bitsandbytes' paged 8-bit AdamW the states live in CUDA unified
memory, which pages them to the host when the card is full. The weights (bf16, or fp32) are their own
master copy: there is no other.

To DeepSpeed (ZeRO stage 0, no mixed-precision wrapper) this is an ordinary client optimizer whose
`step()` finds nothing left to do; the LR schedule sets the outer parameter groups' rates, which each
hook copies into its inner optimizer before stepping. What follows from updating during backward, and
what the recipe checks enforce: one micro-batch per optimizer step (there is no gradient to
accumulate), no clipping by the global norm (it is known only after the first parameters have been
updated), one process (the gradients are not reduced over ranks). A step whose loss is not finite is
not applied: `arm(loss)` reads the loss before its backward (one host sync per step) and the hooks
then only drop the gradients, which is what the NaN guard expects of a bad step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# the hyperparameters of one outer group that its parameters' inner optimizers follow
FOLLOWED = ("lr", "betas", "eps", "weight_decay")


class StepInBackward(torch.optim.Optimizer):
    """Per-parameter optimizers stepped from `register_post_accumulate_grad_hook`; `step()` is a no-op.

    groups: torch parameter groups (dicts) or a list of parameters; defaults: lr, betas, eps, weight_decay.
    make: builds the optimizer of one parameter from one parameter group.
    """

    def __init__(self, groups, defaults: dict, make: Callable[[list[dict]], torch.optim.Optimizer]):
        super().__init__(groups, defaults)
        self.armed = True
        self._inner: dict[torch.nn.Parameter, tuple[torch.optim.Optimizer, int]] = {}
        for index, group in enumerate(self.param_groups):
            settings = {key: group[key] for key in FOLLOWED}
            for parameter in group["params"]:
                self._inner[parameter] = (make([{"params": [parameter], **settings}]), index)
                parameter.register_post_accumulate_grad_hook(self._update)

    def _update(self, parameter: torch.nn.Parameter) -> None:
        inner, index = self._inner[parameter]
        if self.armed:
            group, target = self.param_groups[index], inner.param_groups[0]
            for key in FOLLOWED:  # the schedule's rate (and a resumed run's settings), as of this step
                target[key] = group[key]
            inner.step()
        parameter.grad = None

    def arm(self, loss: torch.Tensor) -> None:
        """Before a backward: apply its updates only when its loss is finite (a bad step changes nothing)."""
        self.armed = bool(torch.isfinite(loss.detach()).all())

    @torch.no_grad()
    def step(self, closure=None):
        """Nothing to do: every parameter was updated during backward."""
        return closure() if closure is not None else None

    def state_dict(self) -> dict:
        saved = super().state_dict()
        saved["inner"] = [inner.state_dict() for inner, _ in self._inner.values()]
        return saved

    def load_state_dict(self, state_dict: dict) -> None:
        inner = state_dict.get("inner")
        if inner is None or len(inner) != len(self._inner):
            raise ValueError(
                f"the checkpoint's optimizer holds {len(inner or [])} per-parameter optimizers and this "
                f"model has {len(self._inner)} trainable parameters"
            )
        super().load_state_dict({key: value for key, value in state_dict.items() if key != "inner"})
        for (parameter, (optimizer, _)), saved in zip(self._inner.items(), inner):
            optimizer.load_state_dict(saved)
            state = optimizer.state[parameter]
            for key, value in state.items():
                if torch.is_tensor(value) and key != "step":
                    state[key] = _placed(optimizer, parameter, key, value)


PAGED_MIN_NUMEL = 100_000  # bitsandbytes pages the moments of parameters this large (Optimizer8bit.get_state_buffer)


def _placed(optimizer: torch.optim.Optimizer, parameter: torch.nn.Parameter, key: str, value: torch.Tensor):
    """A loaded state tensor where the optimizer keeps it while training: a paged optimizer's moments of a large
    parameter in a fresh unified-memory buffer (as bitsandbytes creates them), the rest on the parameter's device.
    bitsandbytes' own load_state_dict leaves the moments where the checkpoint put them (the host, since memtrain
    loads checkpoints of this mode there: a second copy on the card would not fit)."""
    if (
        getattr(optimizer, "is_paged", False)
        and parameter.is_cuda
        and key.startswith("state")
        and parameter.numel() >= PAGED_MIN_NUMEL
    ):
        import bitsandbytes.functional as F  # noqa: PLC0415, N812 — optional dependency, only for paged optimizers

        paged = F.get_paged(*value.shape, dtype=value.dtype, device=parameter.device)
        paged.copy_(value)
        optimizer.page_mng.paged_tensors.append(paged)
        return paged
    return value.to(parameter.device)
