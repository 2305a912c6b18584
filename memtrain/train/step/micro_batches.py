"""One optimizer step over a fixed set of samples, split into micro-batches of any size.

The loop owns the accumulation boundary: before each backward it tells DeepSpeed whether this is
the step's last micro-batch (`set_gradient_accumulation_boundary`), so the gradient reduction and
the offload copy of the final gradients overlap that backward, and `step()` only updates. Every
micro-batch's summed token loss is divided by the target tokens of the whole global batch,
so gradients are the same whatever the micro-batch size, and the global batch never changes when
the batch policy changes the micro-batch.

An out-of-memory error in the forward pass of a micro-batch leaves the gradients of the
micro-batches already done untouched; the rest of the step's samples are retried at the smaller
size. An OOM in backward may have added part of a gradient. Under ZeRO-3 zeroing the optimizer's
gradients drops it and the step's samples all run again; under ZeRO-1/2 DeepSpeed keeps partial
gradients in buffers that zero_grad does not clear (measured: the discarded micro-batch still
changed the update), so the loop saves the last completed step and restarts from it instead.

With several processes, a forward OOM on any rank is shared (one flag all-reduced per micro-batch)
so all ranks retry together. An OOM inside one rank's backward is not recoverable that way (the
others are already waiting in its gradient reductions); the run stops there.
"""

from __future__ import annotations

import torch

from memtrain.model.compiled import ready_for_replay
from memtrain.monitor.profiler import phase
from memtrain.train.optim.in_backward import StepInBackward
from memtrain.train.runtime.oom import abandon_failed_frames, is_oom


class OomDuringStep(Exception):
    """An OOM in a micro-batch's forward or backward; `elsewhere`: another rank's forward ran out, and this rank
    stopped with it."""

    def __init__(self, error: BaseException, in_backward: bool, elsewhere: bool = False):
        super().__init__(str(error))
        self.error, self.in_backward, self.elsewhere = error, in_backward, elsewhere


def run_micro_batches(
    engine,
    loader,
    *,
    batches: list[list[int]],
    normaliser: float,
    loss_sum: torch.Tensor,
    before=None,
    after=None,
    in_backward=None,
    any_rank=None,
    replay_graphs: bool = False,
) -> int:
    """Forward + backward over micro-batches, adding to loss_sum; returns how many completed.

    Raises OomDuringStep with how many completed (as `.done`) when one runs out of memory.
    any_rank(flag) -> bool, with several processes: whether any rank ran out of memory in this
    forward. Then every rank skips this backward and shrinks alike, so their gradient reductions
    stay paired (a rank that went on alone would wait in a collective for the one retrying).
    replay_graphs: the compiled layers replay CUDA graphs (train.cuda_graphs resolved); each micro-batch first makes
    them ready for it (memtrain.model.compiled.ready_for_replay).
    """
    trainable = [p for p in engine.module.parameters() if p.requires_grad] if replay_graphs else []
    for done, indices in enumerate(batches):
        if done + 1 < len(batches):
            loader.prefetch(batches[done + 1])
        batch = loader.get(indices)
        oom = None
        try:
            if before is not None:
                before(done, len(indices))
            if replay_graphs:
                ready_for_replay(trainable)
            with phase("forward"):
                token_loss_sum, _ = engine(**batch)  # input_ids, labels (and position_ids for packed samples)
        except Exception as error:  # noqa: BLE001 — only OOMs are handled; the rest re-raise
            oom = _as_oom(error, False, done)
            if not isinstance(oom, OomDuringStep):
                raise oom from error
        if any_rank is not None and any_rank(oom is not None) and oom is None:
            token_loss_sum = None  # drop this forward's graph; another rank must retry smaller
            oom = OomDuringStep(RuntimeError("out of memory on another rank"), False, elsewhere=True)
            oom.done = done
        if oom is not None:
            raise oom
        try:
            loss = token_loss_sum * normaliser
            if in_backward is not None:  # test hook: raise from inside autograd's backward pass
                loss.register_hook(lambda grad, i=done, n=len(indices): in_backward(i, n) or grad)
            if isinstance(engine.optimizer, StepInBackward):  # updates happen in this backward: not on a NaN loss
                engine.optimizer.arm(loss)
            engine.set_gradient_accumulation_boundary(done + 1 == len(batches))
            with phase("backward"):
                engine.backward(loss, scale_wrt_gas=False)
        except Exception as error:  # noqa: BLE001
            raise _as_oom(error, True, done) from error
        loss_sum += token_loss_sum.detach().float()
        if after is not None:
            after(indices)
    return len(batches)


def _as_oom(error: BaseException, in_backward: bool, done: int) -> BaseException:
    if not is_oom(error):
        return error
    abandon_failed_frames(error)
    oom = OomDuringStep(error, in_backward)
    oom.done = done
    return oom
