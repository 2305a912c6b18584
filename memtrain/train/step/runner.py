"""One optimizer step's gradients with the policies around it: micro-batches sized by the batch
policy, OOM recovery (retry smaller, drop or restart), the early-warning forecast, checkpoints.

The loop (`loop.py`) decides which samples and when; a StepRunner makes their gradients survive
memory pressure without losing or repeating a sample.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from memtrain.data.rows.loader import BatchLoader
from memtrain.errors import Problem, UserError
from memtrain.files import write_error
from memtrain.monitor.forecast import PeakForecast
from memtrain.monitor.metrics import MetricsLog
from memtrain.recipe.schema import Recipe
from memtrain.train.resolve import max_steps_left
from memtrain.train.runtime.distributed import Place, any_rank, max_over_ranks, peer_gone
from memtrain.train.runtime.oom import dump_memory_snapshot, release_memory
from memtrain.train.state.checkpoint import (
    LoopState,
    kept_through,
    kept_while_saving,
    latest_checkpoint,
    partial_save,
    prune,
    save_checkpoint,
    step_of_name,
)
from memtrain.train.state.restart_note import RestartEveryProcess, RestartNote, remove_note, write_note
from memtrain.train.state.storage import (
    expected_checkpoint_bytes,
    is_disk_full,
    save_failed,
    saved_optimizer_bytes_per_param,
    say,
    space_warning,
)
from memtrain.train.step.batch_policy import BatchPolicy, GiveUp
from memtrain.train.step.hooks import Hooks
from memtrain.train.step.micro_batches import OomDuringStep, run_micro_batches

if TYPE_CHECKING:  # for the reader only: importing DeepSpeed is slow and sets up its accelerator
    import deepspeed


def _remove_partial(path: Path, attempts: int = 20, pause_s: float = 0.1) -> None:
    """Remove a failed save's directory. Another rank may still be writing into it (its own failure comes a moment
    later): removing again until it stays gone leaves no partial save behind."""
    for _ in range(attempts):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return
        time.sleep(pause_s)


@dataclass(kw_only=True)
class StepRunner:
    """What one optimizer step needs: the engine and the policies around it."""

    r: Recipe
    place: Place
    engine: "deepspeed.DeepSpeedEngine"
    policy: BatchPolicy
    metrics: MetricsLog
    forecast: PeakForecast
    loader: BatchLoader
    hooks: Hooks
    run_dir: Path
    zero3: bool
    save: bool
    state: LoopState
    cap_bytes: int
    max_steps_stop: int | None = None  # the step --max-steps stops this attempt at (run.max_steps_stop)

    def checkpoint(self) -> Path:
        self.state.batch_policy = self.policy.state_dict()
        self.state.recipe = self.r.model_dump(mode="json")  # what a resume compares its recipe with
        step, main = self.state.step, self.place.is_main
        p, o = self.r.precision, self.r.optimizer
        needed = expected_checkpoint_bytes(
            self.run_dir,
            self.engine.module,
            saved_optimizer_bytes_per_param(
                p.storage,
                p.master,
                zero_stage=self.r.zero_stage,
                eight_bit=o.eight_bit,
                in_backward=o.step_in_backward,
            ),
            ranks=self.place.world_size,
        )
        keep_last = self.r.train.keep_last
        fault = self.hooks.save_fault(step)
        try:
            if main:  # save_checkpoint prunes so too; first here, so the space check counts the room it frees
                prune(self.run_dir, kept_while_saving(keep_last), kept_through(self.state))
            free, warning = space_warning(self.run_dir, needed, keep_last) if main else (None, None)
            if warning:
                self.metrics.event("disk", step, free_bytes=free, needed_bytes=needed, message=warning)
                say(warning)
            path = save_checkpoint(self.engine, self.run_dir, self.state, self.place.rank, keep_last, fault=fault)
        except Exception as error:  # a full disk, a read-only one, no permission: one line, not a traceback
            if not main and not partial_save(self.run_dir, step).exists():
                # rank 0's save failed first and removed the partial save this rank was writing into: it says why;
                # this rank ends with the same code and nothing more to say
                raise UserError([]) from None
            if write_error(error) is None:
                if main and peer_gone(error):  # another rank's save failed (its disk) and it left, saying why
                    _remove_partial(partial_save(self.run_dir, step))
                    self._end(step, "save_failed_on_another_rank")
                    raise UserError([]) from None
                raise
            if main:
                _remove_partial(partial_save(self.run_dir, step))  # frees what it took
            self._end(step, "disk_full" if is_disk_full(error) else "unwritable")
            raise save_failed(self.run_dir, error, step, needed, keep_last) from None
        self.metrics.event("checkpoint", step, path=str(path))
        if main:  # this checkpoint carries the batch policy's state: a restart note before it is spent
            remove_note(self.run_dir)
        return path

    def _end(self, step: int, status: str) -> None:
        """The run's end record and the buffered metrics, as far as the disk that failed a save still takes them."""
        try:
            self.metrics.event("run", step, event="end", status=status)
            self.metrics.close()
        except OSError:  # metrics.jsonl is in the run directory that could not be written
            pass

    def forward_backward(self, mine: list[int], targets: int) -> tuple[torch.Tensor, int, int] | None:
        """Gradients of this rank's samples, in micro-batches the policy sizes, surviving OOMs.

        Returns (summed token loss, micro-batches run, OOMs survived); None when an OOM in ZeRO-1/2
        backward left gradients that cannot be dropped, after saving the last completed step.
        """
        step, device = self.state.step, self.place.device
        self.hooks.nan.arm(step)  # test hook: this step's loss becomes NaN (MEMTRAIN_INJECT_NAN)
        if self.place.on_cuda:
            torch.cuda.reset_peak_memory_stats(device)
        injector, backward_injector = self.hooks.oom, self.hooks.oom_backward
        loss_sum = torch.zeros((), device=device)
        remaining, micro_batches, ooms = mine, 0, 0
        failed: Failed | None = None  # the last forward OOM of this step
        while remaining:
            batches = self.loader.split(remaining, self.policy.micro_batch)
            if self.place.world_size > 1 and self.loader.pack_steps:
                batches = self._as_many_as_every_rank(remaining, batches, failed)
            try:
                micro_batches += run_micro_batches(
                    self.engine,
                    self.loader,
                    batches=batches,
                    normaliser=self.place.world_size / targets,
                    loss_sum=loss_sum,
                    before=lambda i, size, done=micro_batches: injector.maybe_raise(step, done + i, size),
                    after=self.hooks.sample_trace.add,
                    in_backward=(
                        lambda i, size, done=micro_batches: backward_injector.maybe_raise(step, done + i, size)
                    )
                    if backward_injector
                    else None,
                    any_rank=(lambda flag: any_rank(flag, device)) if self.place.world_size > 1 else None,
                    replay_graphs=self.r.train.cuda_graphs is True,
                )
                remaining = []
            except OomDuringStep as oom:
                if self.r.optimizer.step_in_backward:
                    raise self._oom_stepping_in_backward(oom) from None
                if oom.in_backward and self.place.world_size > 1:
                    raise self._restart_every_process(oom) from None
                ooms += 1
                failed = Failed(self.policy.micro_batch, _said(oom.error), here=not oom.elsewhere)
                self._shrink_after_oom(oom, dump_memory_snapshot(self.run_dir, step) if ooms == 1 else None)
                if oom.in_backward and not self.zero3:
                    if not self.save:
                        raise UserError(
                            Problem(
                                f"out of memory in backward at step {step + 1} under ZeRO-1/2; with --no-save there "
                                "is no checkpoint to restart from",
                                hint="lower batch.micro_batch or run without --no-save",
                            )
                        ) from None
                    self.checkpoint()
                    self.hooks.sample_trace.discard()  # this step's gradients are not applied; its rerun traces anew
                    self.metrics.event("run", step, event="end", status="restart")
                    self.metrics.close()
                    return None
                if oom.in_backward:  # ZeRO-3: zeroing drops the partial gradients; run every sample again
                    self.engine.optimizer.zero_grad(set_to_none=True)
                    self.hooks.sample_trace.discard()
                    loss_sum.zero_()
                    take_metrics = getattr(self.engine.module, "take_metric_sums", None)  # a preference objective's
                    if take_metrics is not None:  # rewards of the forwards run so far: they run again
                        take_metrics()
                    remaining, micro_batches = mine, 0
                else:  # forward: the finished micro-batches' gradients stand
                    micro_batches += oom.done
                    remaining = _left(remaining, batches[: oom.done])
        self.hooks.nan.arm(-1)
        return loss_sum, micro_batches, ooms

    def _oom_stepping_in_backward(self, oom: OomDuringStep) -> UserError:
        """No retry when each micro-batch is an optimizer step: smaller pieces would be more, smaller steps, and
        a backward that ran out of memory has already updated part of the model. The last checkpoint stands."""
        step = self.state.step
        said = _said(oom.error)
        self.metrics.event(
            "oom", step, micro_batch=self.policy.micro_batch, in_backward=oom.in_backward, fatal=True, error=said
        )
        self.metrics.event("run", step, event="end", status="oom")
        self.metrics.close()
        where = "backward (part of the model was already updated)" if oom.in_backward else "forward"
        return UserError(
            Problem(
                f"out of memory in the {where} of step {step + 1} at micro-batch {self.policy.micro_batch} ({said}); "
                "with optimizer.step_in_backward each micro-batch is an optimizer step, so memtrain cannot retry it "
                "smaller",
                key="batch.global_batch",
                hint="lower batch.global_batch and batch.micro_batch together, or recompute "
                "more layers (checkpointing); `memtrain plan` prices them, and a new run resumes from the last "
                "checkpoint",
            )
        )

    def _as_many_as_every_rank(
        self, remaining: list[int], batches: list[list[int]], failed: Failed | None
    ) -> list[list[int]]:
        """Steps laid out packed on several processes: each rank's share fills rows of its own, and every rank runs
        the most micro-batches any makes (loader.packed_micro_batches), so that their gradient reductions pair. At a
        step's start that is always possible (equal shares, each at least as many samples as rows); after a forward
        OOM the shares left may not be (a rank with fewer samples left than the micro-batches another needs), and
        every process starts again from the last checkpoint at the smaller size instead."""
        device = self.place.device
        count = max_over_ranks(len(batches), device)
        if failed is None or count <= -max_over_ranks(-len(remaining), device):  # the fewest samples left on a rank
            return batches if count == len(batches) else self.loader.split(remaining, self.policy.micro_batch, count)
        world = self.place.world_size
        rank = -max_over_ranks(-(self.place.rank if failed.here else world), device)  # the lowest that ran out
        what = (
            f"out of memory in a forward of step {self.state.step + 1} on rank {rank} (micro-batch "
            f"{failed.micro_batch}); the samples left on the processes are too uneven to lay out packed in as many "
            "micro-batches on each, so it cannot be retried in place"
        )
        said = failed.said if failed.here else f"out of memory on rank {rank}"
        raise self._start_every_process_again(what, failed.micro_batch, said, rank=rank, in_backward=False)

    def _restart_every_process(self, oom: OomDuringStep) -> Exception:
        """An OOM in backward with several processes: the others wait for this one inside a gradient reduction, so it
        cannot retry in place or save (both need them); every process starts again (`_start_every_process_again`)."""
        said = _said(oom.error)
        release_memory(self.place.device)
        failed = self.policy.micro_batch
        self.policy.on_oom()  # GiveUp (a UserError) at the smallest size: said once, exit 2
        what = (
            f"out of memory in backward at step {self.state.step + 1} on rank {self.place.rank} (micro-batch "
            f"{failed}); the other processes wait for it in their gradient reduction, so it cannot be retried in place"
        )
        return self._start_every_process_again(what, failed, said, rank=self.place.rank, in_backward=True)

    def _start_every_process_again(
        self, what: str, failed: int, said: str, *, rank: int, in_backward: bool
    ) -> Exception:
        """After an OOM on `rank` at micro-batch `failed` that no process can retry in place (the policy has shrunk
        since): on one node a note (restart_note.py), and every process starts again from the last checkpoint at the
        smaller micro-batch; across nodes, or without a checkpoint to go back to, the run stops and says what to run.
        A forward's OOM was recorded when the policy shrank (`_shrink_after_oom`); a backward's is recorded by the
        next attempt."""
        step, smaller = self.state.step, self.policy.micro_batch
        if smaller >= failed:
            return UserError(
                Problem(
                    f"{what}, and micro-batch {failed} is the smallest this run may use",
                    key="batch.global_batch",
                    hint="recompute more layers (checkpointing) or offload "
                    "more; `memtrain plan` prices them, and the run resumes from its last checkpoint",
                )
            )
        checkpoint = latest_checkpoint(self.run_dir) if self.save else None
        resume_step = step_of_name(checkpoint) if checkpoint is not None else 0
        if not self.save:
            return UserError(
                Problem(
                    f"{what}; with --no-save there is no checkpoint to start every process from",
                    key="batch.micro_batch",
                    hint=f"set batch.micro_batch={smaller}, or run without --no-save",
                )
            )
        if self.r.hardware.nodes > 1:  # the launchers of the other nodes would not start again
            return UserError(
                Problem(
                    f"{what}",
                    key="batch.micro_batch",
                    hint=f"run the same command on every node "
                    f"with batch.micro_batch={smaller}: it resumes from step {resume_step}",
                )
            )
        write_note(
            self.run_dir,
            RestartNote(
                resume_step,
                step,
                rank,
                failed,
                smaller,
                said,
                max_steps_left(self.max_steps_stop, resume_step),
                in_backward=in_backward,
            ),
        )
        where = f"step {resume_step}, its last checkpoint" if resume_step else "the start (no checkpoint yet)"
        return RestartEveryProcess(f"{what}: every process starts again from {where}, at micro-batch {smaller}")

    def _shrink_after_oom(self, oom: OomDuringStep, snapshot: Path | None) -> None:
        step = self.state.step
        release_memory(self.place.device)
        if self.place.on_cuda:  # the failed attempt's peak must not count as this step's
            torch.cuda.reset_peak_memory_stats(self.place.device)
        self.forecast.reset()
        try:
            decision = self.policy.on_oom()
        except GiveUp as give_up:
            self.metrics.event("oom", step, micro_batch=self.policy.micro_batch, snapshot=_str(snapshot), fatal=True)
            if self.save:  # the last completed step is kept; this one's gradients are not applied
                self.engine.optimizer.zero_grad(set_to_none=True)
                self.checkpoint()
            self.metrics.event("run", step, event="end", status="gave_up", message=str(give_up))
            self.metrics.close()
            raise
        self.metrics.event(
            "oom", step, micro_batch=decision.old_micro_batch, snapshot=_str(snapshot), in_backward=oom.in_backward
        )
        self._log_decision(decision)

    def adapt_batch(self) -> None:
        """After a step: the batch policy sees its peak; the forecast warns (and shrinks) before an OOM."""
        if not self.place.on_cuda:
            return
        # every rank decides from the largest peak, so micro-batches (and collectives) stay paired
        peak_reserved = max_over_ranks(torch.cuda.max_memory_reserved(self.place.device), self.place.device)
        self._log_decision(self.policy.after_step(peak_reserved))
        self.forecast.observe(peak_reserved, micro_batch=self.policy.micro_batch)
        if self.cap_bytes and self.forecast.warns(self.cap_bytes, self.r.batch.adaptive.shrink_above):
            predicted = int(self.forecast.forecast(1))
            self.metrics.event("forecast", self.state.step, predicted_peak_bytes=predicted, cap_bytes=self.cap_bytes)
            self._log_decision(self.policy.before_step(predicted))

    def _log_decision(self, decision) -> None:
        if decision is not None:
            self.metrics.event(
                "batch",
                self.state.step,
                old_micro_batch=decision.old_micro_batch,
                new_micro_batch=decision.new_micro_batch,
                reason=decision.reason,
            )


@dataclass(frozen=True)
class Failed:
    """A forward OOM of the step being run: the micro-batch it failed at, its error's first line, and whether this
    rank ran out (else another did, and this one stopped with it)."""

    micro_batch: int
    said: str
    here: bool


def _str(path) -> str | None:
    return str(path) if path is not None else None


def _said(error: BaseException) -> str:
    """An error's first line (PyTorch's numbers for an OOM), or its type where it says nothing."""
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _left(samples: list[int], done: list[list[int]]) -> list[int]:
    """`samples` without those of the `done` micro-batches, in order. Micro-batches laid out packed hold the step's
    samples longest first, not as consecutive slices; a sample twice in a step (a step across an epoch's end) is
    taken out as often as it was done."""
    counts = Counter(i for batch in done for i in batch)
    left = []
    for sample in samples:
        if counts[sample]:
            counts[sample] -= 1
        else:
            left.append(sample)
    return left
