"""The NaN / divergence guard: what the loop does after each optimizer step besides counting it.

A step whose loss is not finite, or whose gradient norm is not (DeepSpeed then skips the update, as
fp16 loss scaling does; `engine.skipped_steps` counts it), is a bad step: its update is not applied,
it is recorded, and no checkpoint is saved while the last step was bad. `train.max_bad_steps` bad
steps in a row stop the run with exit 2 (`Diverged`), naming the step and the likely cause, and the
last good checkpoint stays the newest. Under fp16, skipped updates are the loss scaler calibrating
and do not count; a non-finite loss does.

A finite loss that rises far above the best seen so far is a divergence warning (a metrics event and
a line), once per episode. The first DIVERGENCE_AFTER_STEPS steps of an attempt warn of nothing (early
losses jump), but their losses count towards the best: a loss that blows up from step 1 is far above
step 1's loss and is reported once the grace is over. The best loss, the steps seen and whether an episode is
under way are saved in checkpoints (LoopState.divergence), so a resumed run warns exactly as an uninterrupted one
would: a loss that rose before the stop is still far above the best from before it.

While the loss is far above its best (in the grace steps too: a loss far from step 2 on was pruned away before the
warning), the state names the step of the best loss (`keep_through`): pruning then keeps the newest checkpoint at or
before it beside the newest keep_last (checkpoint.prune), so a run that diverged still has one from before.

With several processes the verdict is agreed by one all-reduce per step (a sum of: one stop count per
stop signal, a bad-step count, the token-loss sum), so every rank saves, stops or goes on at the same
step, reports the same signal (SIGTERM over SIGINT: 128 + it on every rank, also on those no signal
reached), and logs the loss of the whole global batch, as one process would.
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass
from pathlib import Path

import torch

from memtrain.data.tokens.cache import damaged_entries
from memtrain.errors import Problem, UserError
from memtrain.model.layers import hf_model
from memtrain.monitor.metrics import MetricsLog
from memtrain.recipe.schema import Recipe
from memtrain.train.state.checkpoint import latest_checkpoint

NAN_ENV = "MEMTRAIN_INJECT_NAN"
# "far above": the loss is this much over its best (and at least DIVERGENCE_MIN_RISE nats), after a few steps
DIVERGENCE_RATIO = 1.5
DIVERGENCE_MIN_RISE = 1.0
DIVERGENCE_AFTER_STEPS = 5
# A preference objective's step loss is the mean over a global batch of a few pairs, each of whose losses spans
# orders of magnitude (-log sigmoid of a margin): one batch's 1.3 after another's 0.1 is noise, not divergence. Its
# watch reads an exponential moving average of the step losses, new weight 1 - this (about the last ten steps);
# an SFT loss, the mean over thousands of tokens, is read as it is.
PREFERENCE_LOSS_SMOOTHING = 0.9
# the signals a stop request may come from (the loop's handlers); the highest-numbered one any rank got wins
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Diverged(UserError):
    """The loss or gradients stayed non-finite for train.max_bad_steps steps in a row."""


@dataclass(frozen=True)
class Verdict:
    stop: bool  # an interruption was requested on some rank: save (unless bad) and stop, all together
    bad: bool  # this step's update was not applied (non-finite loss or gradient norm) on some rank
    loss: torch.Tensor | float = math.nan  # the mean token loss of the whole global batch (what gets logged)
    signum: int | None = None  # stop: the signal that asked, the same on every rank (exit 128 + it)

    @property
    def may_save(self) -> bool:
        return not self.bad


class NanInjector:
    """Test hook: the loss of chosen steps (0-based, as the loop counts them) becomes NaN, through the
    input embeddings, so the gradients are NaN too. Spec: comma-separated steps, e.g. '3,4,5'."""

    def __init__(self, steps: frozenset[int] = frozenset()):
        self.steps = steps
        self.armed = False

    @classmethod
    def parse(cls, spec: str, source: str = NAN_ENV) -> "NanInjector":
        try:
            return cls(frozenset(int(part) for part in spec.split(",") if part.strip()))
        except ValueError:
            raise UserError(
                Problem(
                    f"cannot read {spec!r} as steps",
                    key=source,
                    hint="write the steps as numbers, comma-separated, e.g. '3,4,5'",
                )
            ) from None

    def __bool__(self) -> bool:
        return bool(self.steps)

    def arm(self, step: int) -> None:
        self.armed = step in self.steps

    def attach(self, model: torch.nn.Module) -> None:
        if not self.steps:
            return
        embeddings = hf_model(model).get_input_embeddings()
        embeddings.register_forward_hook(lambda module, args, out: out * float("nan") if self.armed else out)


class Guard:
    def __init__(
        self,
        recipe: Recipe,
        metrics: MetricsLog,
        world_size: int,
        device: torch.device,
        run_dir: Path,
        saved: dict | None = None,
    ):
        """saved: `state_dict()` of the guard of the run this one resumes ({} or None: a fresh start)."""
        self.max_bad = recipe.train.max_bad_steps
        self.fp16 = recipe.precision.compute == "fp16"
        self.recipe, self.metrics, self.world_size, self.device, self.run_dir = (
            recipe,
            metrics,
            world_size,
            device,
            run_dir,
        )
        self.streak = 0
        self.first_bad_step: int | None = None
        saved = saved or {}
        self.best_loss: float | None = saved.get("best_loss")
        self.good_steps = int(saved.get("good_steps", 0))
        self.diverging = bool(saved.get("diverging", False))
        self.best_step: int | None = saved.get("best_step")
        self.keep_through: int | None = saved.get("keep_through")  # see the module doc
        self.smoothing = PREFERENCE_LOSS_SMOOTHING if recipe.train.objective != "sft" else 0.0
        self.smoothed_loss: float | None = saved.get("smoothed_loss")
        self.warning: str | None = None  # for the run's last line: the loss diverged at some point

    def state_dict(self) -> dict:
        """What a resumed run's guard continues from (saved in LoopState.divergence)."""
        return {
            "best_loss": self.best_loss,
            "good_steps": self.good_steps,
            "diverging": self.diverging,
            "best_step": self.best_step,
            "keep_through": self.keep_through,
            "smoothed_loss": self.smoothed_loss,
        }

    def after_step(
        self, step: int, loss_sum: torch.Tensor, targets: int, engine, skipped_before: int, stop_signum: int | None
    ) -> Verdict:
        """Judge optimizer step `step` (1-based, just taken) from this rank's token-loss sum over the global
        batch's `targets` target tokens, and this rank's stop request (the signal, or None); raises Diverged
        after max_bad_steps bad in a row."""
        world = self.world_size
        skipped = engine.skipped_steps > skipped_before
        if world == 1:
            loss = loss_sum / (targets / world)  # as before several ranks shared it: exact-resume tests compare these
            value = float(loss)  # one host sync; DeepSpeed's overflow check has synchronised already
            stop, bad = stop_signum is not None, not math.isfinite(value) or (skipped and not self.fp16)
            signum = stop_signum
        else:
            signum, skipped_somewhere, total = self._agree(stop_signum, skipped and not self.fp16, loss_sum)
            value = loss = total / targets  # a rank's non-finite loss makes the sum non-finite: bad everywhere
            stop, bad = signum is not None, not math.isfinite(value) or skipped_somewhere
        if not bad:
            self.streak, self.first_bad_step = 0, None
            self._watch_divergence(step, value)
            return Verdict(stop, False, loss, signum)
        self.streak += 1
        self.first_bad_step = self.first_bad_step or step
        norm = engine.get_global_grad_norm() if hasattr(engine, "get_global_grad_norm") else None
        self.metrics.event(
            "bad_step", step, loss=value, grad_norm=_float(norm), in_a_row=self.streak, update_skipped=True
        )
        if self.streak >= self.max_bad:
            checkpoint = latest_checkpoint(self.run_dir)
            message = (
                f"the loss or gradient norm was not finite (NaN/inf) for {self.streak} steps in a row, from "
                f"step {self.first_bad_step}; no checkpoint was saved from that state"
                + (f", the newest is {checkpoint}" if checkpoint else "")
            )
            self.metrics.event("run", step, event="end", status="diverged", message=message)
            self.metrics.flush()
            raise Diverged(Problem(message, key="train.max_bad_steps", hint=self.likely_cause()))
        return Verdict(stop, True, loss, signum)

    def likely_cause(self) -> str:
        return self._likely_setting() + damaged_input_note()

    def _likely_setting(self) -> str:
        r = self.recipe
        if self.fp16:
            return (
                "fp16 overflowed its range (65504): use precision.compute=bf16, or keep more modules in fp32 "
                "(precision.fp32_modules); then run again to resume from the last good checkpoint"
            )
        if r.optimizer.weight_decay > 0.1:
            return (
                f"optimizer.weight_decay={r.optimizer.weight_decay} is high (0-0.1 is usual): lower it and run "
                "again; the resumed run uses the new value"
            )
        return (
            f"the learning rate is likely too high (optimizer.lr={r.optimizer.lr:g}): lower it or raise "
            "schedule.warmup_steps, and run again; the resumed run uses the new value"
        )

    def _watch_divergence(self, step: int, value: float) -> None:
        """Warn once per episode of a loss far above its best. The grace steps set the best but neither warn
        nor start an episode: a loss already far by step 2 must still be reported after the grace. A preference
        objective's loss is watched through its moving average (PREFERENCE_LOSS_SMOOTHING)."""
        self.good_steps += 1
        if self.smoothing:
            previous = value if self.smoothed_loss is None else self.smoothed_loss
            value = self.smoothed_loss = self.smoothing * previous + (1 - self.smoothing) * value
        if self.best_loss is None or value < self.best_loss:
            self.best_loss, self.best_step = value, step
        far = value > max(self.best_loss * DIVERGENCE_RATIO, self.best_loss + DIVERGENCE_MIN_RISE)
        self.keep_through = self.best_step if far else None
        if self.good_steps <= DIVERGENCE_AFTER_STEPS:
            return
        if far and not self.diverging:
            self.metrics.event("divergence", step, loss=value, best_loss=self.best_loss)
            self.warning = (
                f"the loss{' (its moving average)' if self.smoothing else ''} rose to {value:.3g} at step {step}, "
                f"far above its best {self.best_loss:.3g} "
                f"— lower optimizer.lr (now {self.recipe.optimizer.lr:g}); the newest checkpoint from up to step "
                f"{self.best_step}, the best loss, is kept while the loss stays high" + damaged_input_note()
            )
        self.diverging = far

    def _agree(self, stop_signum: int | None, bad: bool, loss_sum: torch.Tensor) -> tuple[int | None, bool, float]:
        """One all-reduce (a sum) for the verdict and the batch loss: a count per stop signal, a bad-step count
        and the token-loss sum. Returns the stop signal (the highest-numbered any rank got; None: no stop),
        whether some rank's step was bad, and the global batch's token-loss sum."""
        import torch.distributed as dist

        counts = [float(stop_signum == sig) for sig in STOP_SIGNALS]
        values = torch.tensor([*counts, float(bad), 0.0], device=self.device, dtype=torch.float64)
        values[-1] = loss_sum.detach().to(device=self.device, dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        agreed = values.tolist()
        asked = [sig for sig, count in zip(STOP_SIGNALS, agreed) if count > 0]
        return (int(max(asked)) if asked else None), agreed[len(STOP_SIGNALS)] > 0, agreed[-1]


def damaged_input_note() -> str:
    """What a NaN or divergence message adds when the data check of this start found a damaged input: the token
    cache's entries are rebuilt from the data files, which may be damaged the same way (the same disk, a copy)."""
    found = damaged_entries()
    if not found:
        return ""
    return (
        f"; or a damaged input: {len(found)} token cache entr{'y' if len(found) == 1 else 'ies'} did not verify "
        f"at start-up and {'was' if len(found) == 1 else 'were'} tokenised again ({found[0]}): check the data "
        "files and the disk they are on"
    )


def _float(value) -> float | None:
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None
