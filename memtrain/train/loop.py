"""The training loop: for each optimizer step, this rank's share of the global batch in micro-batches
sized by the batch policy; metrics kept on the device and flushed every `log_every` steps; periodic
atomic checkpoints; a Hugging Face export at the end. Everything it drives is built by `setup.py`;
the start record, the first step's mark, evaluation and the run's end are the named helpers below it.
"""

from __future__ import annotations

import dataclasses
import resource
import signal
import sys
import time
from contextlib import contextmanager

import psutil
import torch

from memtrain.data.rows.loader import step_positions, token_slots
from memtrain.errors import UserError
from memtrain.model.preference import PreferenceLM, preference_metrics
from memtrain.monitor.perplexity import perplexity
from memtrain.monitor.profiler import phase
from memtrain.train.eval.validation_loss import evaluate
from memtrain.train.progress_bar import Progress
from memtrain.train.resolve import max_steps_left
from memtrain.train.runtime.distributed import Place, all_reduce_sum, peer_gone, sum_by_node
from memtrain.train.runtime.result import EXIT_RESTART, RunResult
from memtrain.train.runtime.signals import marked_ending, note_stop, received_stop, stop_asked
from memtrain.train.setup import Training
from memtrain.train.state.final_model import export_model
from memtrain.train.state.restart_note import NOTE_FILE
from memtrain.train.step.guard import Guard

# Steps the start record's padding share is priced over, as `memtrain plan --data` prices it (commands/plan.py).
PADDING_PRICED_STEPS = 1000


class Interrupted:
    """Ctrl-C / SIGTERM: finish the current step, save, exit cleanly."""

    def __init__(self):
        self.requested = False
        self.signum = signal.SIGINT  # the first signal that asked: the exit code is 128 + it

    @contextmanager
    def installed(self):
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

        def request(signum, frame):
            note_stop(signum)
            if (
                self.requested and signum == signal.SIGINT
            ):  # a second Ctrl-C aborts at once (a repeated SIGTERM does not)
                signal.signal(signal.SIGINT, previous[signal.SIGINT])
                raise KeyboardInterrupt
            self.signum = signum if not self.requested else self.signum
            self.requested = True

        for sig in previous:
            signal.signal(sig, request)
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def train(t: Training, quiet: bool = False) -> RunResult:
    """Train a set-up run to its last step (or --max-steps, or an interruption); returns how it ended."""
    r, run, place, state, stepper = t.recipe, t.run, t.place, t.state, t.stepper
    _announce_start(t)
    stop_at = min(run.total_steps, stepper.max_steps_stop or run.total_steps)
    interrupted = Interrupted()
    early = received_stop()  # asked during start-up, where the handler's exception can be lost
    if early is not None:
        interrupted.requested, interrupted.signum = True, early
    guard = Guard(r, t.metrics, place.world_size, place.device, run.run_dir, state.divergence)  # NaN/inf, divergence
    progress = Progress(run.total_steps, enabled=place.is_main and not quiet)
    try:
        return _train_steps(t, stop_at, interrupted, guard, progress)
    except RuntimeError as error:  # a collective broke: another process left, wherever this one was in the step
        _end_after_broken_collective(t, error)
        raise


def _end_after_broken_collective(t: Training, error: RuntimeError) -> None:
    """The run's end record (rank 0) when a collective broke because another process left: `restart` or
    `ended_on_another_rank` where it ended on purpose and said why, `peer_lost` where it died without a word (the
    worker says which, runtime/peers.py); none after a stop this process was asked for."""
    if not t.place.is_main or not peer_gone(error):
        return
    ending = marked_ending()
    if ending is not None:
        status = "restart" if ending == EXIT_RESTART else "ended_on_another_rank"
    elif received_stop() and stop_asked():
        return
    else:
        status = "peer_lost"
    try:
        t.metrics.event("run", t.state.step, event="end", status=status)
        t.metrics.close()
    except OSError:  # metrics.jsonl's disk is the one that failed
        pass


def _train_steps(t: Training, stop_at: int, interrupted: Interrupted, guard: Guard, progress: Progress) -> RunResult:
    """The steps from the state's to `stop_at`, then the run's end: evaluation, export (`_finish`)."""
    r, run, place, state, stepper = t.recipe, t.run, t.place, t.state, t.stepper
    rank, global_batch, per_rank_batch = place.rank, r.batch.global_batch, run.per_rank_batch
    status, eval_loss = "done", None
    with interrupted.installed():
        with progress, t.profiler:
            progress.update(state.step)
            if r.train.eval_generate and state.step == 0:  # the scores before training: exact match, and beside
                eval_loss = _evaluate(t, progress)  # it the validation loss it starts from (every rank: a collective)
                if t.generation is not None:  # rank 0
                    progress.note(t.generation.record(t.model, t.metrics, state.step).describe(state.step))
                if t.startup is not None:
                    t.startup.mark("eval_generate")
            while state.step < stop_at:
                step_start = time.perf_counter()
                samples = t.order.indices(state.step * global_batch, global_batch)
                targets = t.data.train_set.targets(samples)  # of the whole global batch: every rank knows all samples
                outcome = stepper.forward_backward(
                    samples[rank * per_rank_batch : (rank + 1) * per_rank_batch], targets
                )
                if outcome is None:  # an OOM in ZeRO-1/2 backward: saved; the launcher resumes from there
                    return RunResult(
                        status="restart",
                        step=state.step,
                        run_dir=run.run_dir,
                        max_steps_left=max_steps_left(stepper.max_steps_stop, state.step),
                    )
                loss_sum, micro_batches, ooms = outcome
                skipped_before = t.engine.skipped_steps
                with phase("optimizer_step"):
                    t.engine.step()
                verdict = guard.after_step(
                    state.step + 1,
                    loss_sum,
                    targets,
                    t.engine,
                    skipped_before,
                    interrupted.signum if interrupted.requested else None,
                )
                t.hooks.sample_trace.commit(state.step, rank)
                state.divergence = guard.state_dict()  # what any save from here on carries
                state.step += 1
                step_tokens = t.data.train_set.tokens_of(samples)  # padding left out; a pair's two sequences
                state.tokens += step_tokens
                state.target_tokens += t.data.train_set.target_tokens(samples)  # `targets` counts pairs
                # as split at the step's last micro-batch size (an OOM mid-step ran its first micro-batches larger)
                state.padded_tokens += step_positions(
                    t.data.train_set,
                    samples,
                    per_rank_batch,
                    stepper.policy.micro_batch,
                    t.loader.trim,
                    pack_steps=t.loader.pack_steps,
                )
                stepper.adapt_batch()
                _mark_first_step(t)
                step_time_s = time.perf_counter() - step_start
                # loss: the global batch's mean (the guard's all-reduce summed the ranks' shares), as one process logs
                t.metrics.record(
                    "train",
                    state.step,
                    loss=verdict.loss,
                    lr=t.scheduler.get_last_lr()[0],
                    tokens=state.tokens,  # real input tokens, cumulative (before the three counts: targets)
                    target_tokens=state.target_tokens,
                    padded_tokens=state.padded_tokens,
                    tokens_per_s=step_tokens / step_time_s,
                    step_time_s=step_time_s,
                    micro_batch=stepper.policy.micro_batch,
                    grad_accum=micro_batches,
                    ooms=ooms,
                    **_memory_fields(place, t.cap_bytes, r.hardware.nodes),
                    **_loss_scale_fields(t.engine, r),
                    **_preference_fields(t),
                )
                last = state.step == stop_at
                evaluates = state.step % r.train.eval_every == 0 or last
                if evaluates or verdict.stop:  # the bar's loss is then this step's, not that of the last one flushed
                    t.metrics.flush()  # (every log_every steps): the evaluation's record would flush it anyway
                progress.update(state.step, t.metrics.last_flushed)
                t.profiler.step()
                if evaluates:
                    eval_loss = _evaluate(t, progress)
                due = state.step % r.train.save_every == 0 or last or verdict.stop
                if t.options.save and verdict.may_save and due:
                    stepper.checkpoint()
                if verdict.stop:
                    status = "interrupted"
                    interrupted.signum = verdict.signum  # every rank the same, also one that got no signal
                    break
            t.metrics.flush()
        # The end of the run stays under the loop's handlers: a first Ctrl-C / SIGTERM here lets the final
        # evaluation and the export (part of saving) finish; with the model exported the run is done (exit 0, the
        # line says the stop came during the export), and a rerun finds nothing to do. A second Ctrl-C aborts at
        # once, as during training: final/ is then not there, and the rerun exports from the last checkpoint.
        status, exported, stopped_after_export = _finish(t, status, interrupted, progress)
    return RunResult(
        status=status,
        step=state.step,
        run_dir=run.run_dir,
        final_eval_loss=eval_loss,
        exported=exported,
        signum=interrupted.signum,
        warning=guard.warning,
        saved=t.options.save,
        stopped_after_export=stopped_after_export,
    )


def _announce_start(t: Training) -> None:
    """The run's start record, and after it what made this attempt start smaller (another process's OOM)."""
    run, place, state, stepper = t.run, t.place, t.state, t.stepper
    t.metrics.event(
        "run",
        state.step,
        event="resume" if t.resumed_from else "start",
        recipe=run.name,
        gpu_cap_bytes=t.cap_bytes,
        device=str(place.device),
        world_size=place.world_size,
        total_steps=run.total_steps,
        micro_batch=stepper.policy.micro_batch,
        plan_peak_reserved_bytes=run.plan_peak_reserved_bytes,
        process_started=psutil.Process().create_time(),  # the origin of "time to first step"
        pinned_sizes="exact" if place.on_cuda and run.exact_pinned else "power_of_two",
        **_data_fields(t),
    )
    if t.startup is not None:
        t.startup.mark("loop_start")  # the run's start record
    note = t.restarted_after
    if note is None:
        return
    if note.in_backward:  # the failed attempt could not record it (restart_note.py); a forward's it recorded
        t.metrics.event(
            "oom",
            note.oom_step,
            micro_batch=note.failed_micro_batch,
            in_backward=note.in_backward,
            rank=note.rank,
            error=note.error,
            restarted_from=note.resume_step,
        )
        t.metrics.event(
            "batch",
            state.step,
            old_micro_batch=note.failed_micro_batch,
            new_micro_batch=stepper.policy.micro_batch,
            reason="oom",
        )
    if place.is_main:
        where = "backward" if note.in_backward else "forward"
        print(
            f"· starting at micro-batch {stepper.policy.micro_batch}: rank {note.rank} ran out of memory in the "
            f"{where} of step {note.oom_step + 1} at micro-batch {note.failed_micro_batch} ({NOTE_FILE} in "
            "the run directory, until the next checkpoint)",
            file=sys.stderr,
            flush=True,
        )


def _mark_first_step(t: Training) -> None:
    """The first step of this attempt: where the start went, recorded once."""
    if t.startup is None:
        return
    if t.place.on_cuda:
        torch.cuda.synchronize()  # the step's kernels finished, as "first step" means
    t.startup.mark("first_step")
    t.metrics.event("startup", t.state.step, **t.startup.record())
    t.startup = None


def _evaluate(t: Training, progress: Progress) -> float:
    """The validation loss over the run's fixed validation samples, recorded and shown."""
    state = t.state
    eval_loss = evaluate(
        t.engine,
        t.val_loader,
        t.data.val_set,
        samples=t.run.eval_samples,
        micro_batch=t.stepper.policy.micro_batch,
        place=t.place,
        before=lambda i, n: t.hooks.oom_eval.maybe_raise(state.step, i, n),
        on_oom=lambda n: t.metrics.event("oom", state.step, micro_batch=n, phase="eval"),
    )
    pairs = _preference_fields(t)  # of the validation pairs, summed during evaluate's forwards
    scores = pairs or {"perplexity": perplexity(eval_loss)}  # a preference loss is no token NLL: no perplexity
    t.metrics.event("eval", state.step, loss=eval_loss, **scores)
    progress.note_eval(state.step, eval_loss, pairs.get("reward_accuracy"))
    if state.best_eval_loss is None or eval_loss < state.best_eval_loss:
        state.best_eval_loss = eval_loss
    return eval_loss


def _finish(t: Training, status: str, interrupted: Interrupted, progress: Progress):
    """After the last step: the final generation score, the export, the end record. Returns (status, exported, the
    signal that asked to stop while the export ran, which then finished: None when none did). A run whose model is
    exported whole is done, whenever the signal came: a rerun would find nothing to do."""
    r, run, state = t.recipe, t.run, t.state
    if status == "done" and state.step < run.total_steps:
        status = "stopped"
    if status == "done" and t.generation is not None:  # the score after training
        progress.note(t.generation.record(t.model, t.metrics, state.step).describe(state.step))
    exported = None
    if status == "done" and t.options.save:
        try:
            exported = export_model(
                t.engine, t.model, t.data.tokenizer, run.run_dir / "final", t.place.rank, r.zero_stage == 3, r.data
            )
        except UserError:  # could not write (full, read-only): the run's end is on record for `report`
            t.metrics.event("run", state.step, event="end", status="export_failed")
            raise
    stopped_after_export = None
    if interrupted.requested and status in ("done", "stopped"):  # the signal came after the last step's verdict
        if status == "done" and exported is not None:  # final/ is whole: nothing is left for a rerun to do
            stopped_after_export = interrupted.signum
        else:
            status = "interrupted"
    t.metrics.event(
        "run",
        state.step,
        event="end",
        status=status,
        **({"exported": str(exported)} if exported is not None and status != "done" else {}),
    )
    return status, exported, stopped_after_export


def _data_fields(t: Training) -> dict:
    """What became of the training data (samples, truncations), for the run's record, with the padding share of the
    micro-batches as computed: cut to their longest row when the recipe groups by length, over the run's first
    steps (PADDING_PRICED_STEPS at most) at its starting micro-batch. row_padding_share: that of rows of seq_len."""
    train_set, run = t.data.train_set, t.run
    stats = train_set.stats
    global_batch = t.recipe.batch.global_batch
    steps = max(1, min(run.total_steps, PADDING_PRICED_STEPS, len(train_set) // global_batch or 1))
    slots = token_slots(
        t.order,
        train_set,
        global_batch,
        run.per_rank_batch,
        t.stepper.policy.micro_batch,
        t.loader.trim,
        steps,
        pack_steps=t.loader.pack_steps,
    )
    tokens = train_set.tokens_of(t.order.indices(0, steps * global_batch))
    return {
        "data": {
            **dataclasses.asdict(stats),
            "padding_share": 1 - tokens / slots if slots else 0.0,
            "row_padding_share": stats.padding_share,
        }
    }


def _preference_fields(t: Training) -> dict:
    """A preference objective's rewards, reward accuracy and log-probabilities since the last call (the step's
    micro-batches, or an evaluation's), summed over the ranks (every rank calls this: a collective); {} for SFT."""
    module = t.engine.module
    if not isinstance(module, PreferenceLM):
        return {}
    sums = module.take_metric_sums()
    if sums is None:
        return {}
    return preference_metrics(all_reduce_sum(sums))


def _loss_scale_fields(engine, r) -> dict:
    """fp16: DeepSpeed's current loss scale and the steps its overflow check skipped."""
    if r.precision.compute != "fp16":
        return {}
    scale = getattr(engine.optimizer, "cur_scale", None) or getattr(engine.optimizer, "loss_scale", None)
    return {"loss_scale": float(scale) if scale is not None else None, "skipped_steps": engine.skipped_steps}


def _memory_fields(place: Place, cap_bytes: int, nodes: int = 1) -> dict:
    """This rank's memory (rank 0's is what gets logged); on several nodes, each node's host memory too (every
    rank calls this: a collective)."""
    rss = psutil.Process().memory_info().rss
    # the kernel updates ru_maxrss lazily, so it can lag the current RSS read a moment later: the peak is at least it
    peak_rss = max(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    fields = {"host_rss_bytes": rss, "host_peak_rss_bytes": peak_rss}
    if nodes > 1:  # the plan prices host memory per node: the sum of that node's processes
        fields["host_rss_bytes_by_node"] = sum_by_node(rss, place.node_rank, nodes, place.device)
    if place.on_cuda:
        device = place.device
        fields.update(
            gpu_allocated_bytes=torch.cuda.memory_allocated(device),
            gpu_reserved_bytes=torch.cuda.memory_reserved(device),
            gpu_peak_allocated_bytes=torch.cuda.max_memory_allocated(device),
            gpu_peak_reserved_bytes=torch.cuda.max_memory_reserved(device),
            gpu_cap_bytes=cap_bytes,
            # the allocator hit the cap, freed its cache and retried: slow, a sign to plan lower
            gpu_alloc_retries=torch.cuda.memory_stats(device).get("num_alloc_retries", 0),
        )
    return fields
