"""`memtrain run`: setup → train → save, one readable story.

setup:  process group and device, data (validated before anything is written), model with its
        memory policies, DeepSpeed engine from the compiled config, resume from the newest checkpoint.
train:  for each optimizer step, this rank's share of the global batch in micro-batches sized by the
        batch policy; metrics kept on the device and flushed every `log_every` steps.
save:   periodic atomic checkpoints, a final export in Hugging Face format.
"""
from __future__ import annotations

import functools
import json
import math
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from memtrain.errors import DataError, Problem
from memtrain.recipe.load import LoadedRecipe
from memtrain.train.checkpoint import LoopState, latest_checkpoint, load_checkpoint, save_checkpoint
from memtrain.train.distributed import Place, all_reduce_sum, setup_process
from memtrain.train.step import OomDuringStep, run_micro_batches, split, step_targets


@dataclass
class RunResult:
    status: str              # "done" | "stopped" (--max-steps) | "interrupted" | "restart" (OOM in ZeRO-1/2 backward)
    step: int
    run_dir: Path
    final_eval_loss: float | None = None


class Interrupted:
    """Ctrl-C / SIGTERM: finish the current step, save, exit cleanly."""

    def __init__(self):
        self.requested = False

    @contextmanager
    def installed(self):
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

        def request(signum, frame):
            if self.requested:  # a second Ctrl-C aborts at once
                signal.signal(signal.SIGINT, previous[signal.SIGINT])
                raise KeyboardInterrupt
            self.requested = True

        for sig in previous:
            signal.signal(sig, request)
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def resolve_micro_batch(loaded: LoadedRecipe) -> int:
    """The starting micro-batch: the recipe's number, or for "auto" the planner's largest fit."""
    if loaded.recipe.batch.micro_batch != "auto":
        return loaded.recipe.batch.micro_batch
    from memtrain.plan.planner import resolve_micro_batch as planned

    return planned(loaded)


def total_steps(loaded: LoadedRecipe, n_train_samples: int) -> int:
    r = loaded.recipe
    if r.train.steps is not None:
        return r.train.steps
    return max(1, math.ceil(r.train.epochs * n_train_samples / r.batch.global_batch))


def prepare_data(loaded: LoadedRecipe):
    """Tokenizer and datasets, checked against the global batch before any run files are written."""
    from memtrain.data.dataset import build_datasets
    from memtrain.data.tokenizer import load_tokenizer

    from memtrain.model.config import model_config

    r = loaded.recipe
    tokenizer = load_tokenizer(r.model)
    vocab_size = model_config(r.model).vocab_size
    if len(tokenizer) > vocab_size:
        raise DataError(loaded.sources.problem(
            ("model", "tokenizer"), f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary has {vocab_size}",
            "use the model's own tokenizer, or a preset whose vocab_size is at least the tokenizer's"))
    train_set, val_set = build_datasets(r.data, tokenizer, r.train.seed)
    if len(train_set) < r.batch.global_batch:
        raise DataError(loaded.sources.problem(
            ("batch", "global_batch"),
            f"the training data gives {len(train_set)} samples of {r.data.seq_len} tokens, "
            f"fewer than one global batch of {r.batch.global_batch}",
            "add data, lower data.seq_len, or lower batch.global_batch"))
    return tokenizer, train_set, val_set


def evaluate(engine, loader, val_set, samples: int, micro_batch: int, device, world_size: int, rank: int) -> float:
    """Mean token loss over the first `samples` validation samples, shared out over the ranks.

    The sample set depends on neither the number of GPUs nor the current micro-batch, so runs on
    different hardware report comparable numbers.
    """
    engine.eval()
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    tokens = torch.zeros((), device=device, dtype=torch.float64)
    mine = list(range(rank, min(len(val_set), samples), world_size))
    with torch.no_grad():
        for indices in split(mine, micro_batch):
            batch = loader.get(indices)
            token_loss_sum, n_targets = engine(input_ids=batch["input_ids"], labels=batch["labels"])
            loss_sum += token_loss_sum.double()
            tokens += n_targets.double() if torch.is_tensor(n_targets) else n_targets
    engine.train()
    totals = all_reduce_sum(torch.stack([loss_sum, tokens]))
    return float(totals[0] / totals[1].clamp(min=1))


def train(loaded: LoadedRecipe, resume: bool = True, max_steps: int | None = None, profile_steps: int = 0,
          quiet: bool = False, save: bool = True) -> RunResult:
    r = loaded.recipe
    place, cap_bytes = setup_process(r.hardware.gpu, r.hardware.cap_memory)
    tokenizer, train_set, val_set = prepare_data(loaded)
    steps_total = total_steps(loaded, len(train_set))
    run_dir = loaded.output_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    return _train(loaded, place, cap_bytes, tokenizer, train_set, val_set, steps_total, run_dir,
                  resume, max_steps, profile_steps, quiet, save)


def _build_engine(loaded: LoadedRecipe, place: Place, micro_batch: int, steps_total: int):
    import deepspeed

    from memtrain.compile.deepspeed import compile_recipe
    from memtrain.model.build import build_model
    from memtrain.model.checkpointing import apply_checkpointing
    from memtrain.model.precision import apply_precision
    from memtrain.model.wrapper import TrainableLM

    r = loaded.recipe
    ds_config = compile_recipe(r, micro_batch, steps_total, on_cpu=not place.on_cuda)
    model = build_model(r.model, r.precision.compute, place.device, ds_config, seed=r.train.seed)
    apply_checkpointing(model, r.checkpointing)
    apply_precision(model, r.precision)
    lm = TrainableLM(model, r.precision)
    trainable = [p for p in lm.parameters() if p.requires_grad]
    from memtrain.train.schedule import lr_scheduler_factory

    engine, _, _, scheduler = deepspeed.initialize(model=lm, model_parameters=trainable, config=ds_config,
                                                   lr_scheduler=lr_scheduler_factory(r.schedule, steps_total))
    return engine, scheduler, model, ds_config


def _train(loaded, place, cap_bytes, tokenizer, train_set, val_set, steps_total, run_dir, resume, max_steps,
           profile_steps, quiet, save) -> RunResult:
    from memtrain.data.loader import BatchLoader, SampleOrder
    from memtrain.monitor.forecast import PeakForecast
    from memtrain.monitor.metrics import MetricsLog
    from memtrain.monitor.profiler import StepProfiler, phase
    from memtrain.train.batch_policy import BatchPolicy, GiveUp
    from memtrain.train.export import export_model
    from memtrain.train.oom import dump_memory_snapshot, release_memory, start_memory_history
    from memtrain.train.progress import Progress

    r = loaded.recipe
    world, rank, device = place.world_size, place.rank, place.device
    per_rank_batch = r.batch.global_batch // world
    micro_batch = min(resolve_micro_batch(loaded), per_rank_batch)
    eval_samples = r.train.eval_batches * resolve_micro_batch(loaded)  # independent of the GPU count
    engine, scheduler, model, ds_config = _build_engine(loaded, place, micro_batch, steps_total)
    zero3 = ds_config["zero_optimization"]["stage"] == 3

    state = LoopState()
    checkpoint = latest_checkpoint(run_dir) if resume else None
    if checkpoint is not None:
        state = load_checkpoint(engine, checkpoint, rank)
    policy = BatchPolicy(r.batch, per_rank_batch, micro_batch, cap_bytes or 1,
                         prior=_planner_prior(loaded) if place.on_cuda else None)
    if state.batch_policy:
        policy.load_state_dict(state.batch_policy)
    if place.is_main:
        (run_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2))
        (run_dir / "recipe.json").write_text(loaded.recipe.model_dump_json(indent=2))

    metrics = MetricsLog(run_dir / "metrics.jsonl", flush_every=r.train.log_every, enabled=place.is_main,
                         tensorboard_dir=run_dir / "tensorboard")
    metrics.event("run", state.step, event="resume" if checkpoint else "start", recipe=loaded.name,
                  gpu_cap_bytes=cap_bytes, device=str(device), world_size=world, total_steps=steps_total,
                  micro_batch=policy.micro_batch, plan_peak_reserved_bytes=_planned_peak(loaded))
    order = SampleOrder(len(train_set), r.train.seed)
    loader = BatchLoader(train_set, device)
    val_loader = BatchLoader(val_set, device)
    injector, backward_injector = _injectors()
    sample_trace = SampleTrace.from_env()
    forecast = PeakForecast()
    start_memory_history(device)
    profiler = StepProfiler(run_dir, profile_steps, device)
    stop_at = steps_total if max_steps is None else min(steps_total, state.step + max_steps)
    packed = r.data.packing
    interrupted = Interrupted()
    status, eval_loss = "done", None
    progress = Progress(steps_total, enabled=place.is_main and not quiet)

    with interrupted.installed(), progress, profiler:
        progress.update(state.step)
        while state.step < stop_at:
            step = state.step
            step_start = time.perf_counter()
            if place.on_cuda:
                torch.cuda.reset_peak_memory_stats(device)
            samples = order.indices(step * r.batch.global_batch, r.batch.global_batch)
            mine = samples[rank * per_rank_batch:(rank + 1) * per_rank_batch]
            targets = (r.batch.global_batch * (r.data.seq_len - 1)) if packed else step_targets(train_set, samples, device, 1)
            normaliser = world / targets
            loss_sum = torch.zeros((), device=device)
            remaining, micro_batches, ooms = mine, 0, 0
            while remaining:
                batches = split(remaining, policy.micro_batch)
                try:
                    with phase("forward_backward"):
                        done = run_micro_batches(
                            engine, loader, batches, normaliser, loss_sum,
                            before=lambda i, size: injector.maybe_raise(step, micro_batches + i, size),
                            after=sample_trace.add,
                            in_backward=(lambda i, size: backward_injector.maybe_raise(step, micro_batches + i, size))
                            if backward_injector else None)
                    micro_batches += done
                    remaining = []
                except OomDuringStep as oom:
                    ooms += 1
                    snapshot = dump_memory_snapshot(run_dir, step) if ooms == 1 else None
                    release_memory(device)
                    if place.on_cuda:  # the failed attempt's peak must not count as this step's
                        torch.cuda.reset_peak_memory_stats(device)
                    forecast.reset()
                    try:
                        decision = policy.on_oom()
                    except GiveUp as give_up:
                        metrics.event("oom", step, micro_batch=policy.micro_batch, snapshot=_str(snapshot), fatal=True)
                        if save:  # the last completed step is kept; this one's gradients are not applied
                            engine.optimizer.zero_grad(set_to_none=True)
                            save_checkpoint(engine, run_dir, _with_policy(state, policy), rank, r.train.keep_last)
                        metrics.event("run", step, event="end", status="gave_up", message=str(give_up))
                        metrics.close()
                        raise
                    metrics.event("oom", step, micro_batch=decision.old_micro_batch, snapshot=_str(snapshot),
                                  in_backward=oom.in_backward)
                    metrics.event("batch", step, old_micro_batch=decision.old_micro_batch,
                                  new_micro_batch=decision.new_micro_batch, reason=decision.reason)
                    if oom.in_backward and not zero3:
                        return _restart_after_backward_oom(engine, run_dir, state, policy, rank, r, metrics, save,
                                                           loader, val_loader)
                    if oom.in_backward:
                        engine.optimizer.zero_grad(set_to_none=True)  # drops partial ZeRO-3 gradients
                        sample_trace.discard()
                        loss_sum.zero_()
                        remaining, micro_batches = mine, 0
                    else:
                        finished = sum(len(b) for b in batches[:oom.done])
                        micro_batches += oom.done
                        remaining = remaining[finished:]
            with phase("optimizer_step"):
                engine.step()
            sample_trace.commit(step, rank)
            state.step += 1
            state.tokens += targets
            peak_reserved = torch.cuda.max_memory_reserved(device) if place.on_cuda else 0
            decision = policy.after_step(peak_reserved) if place.on_cuda else None
            if decision is not None:
                metrics.event("batch", state.step, old_micro_batch=decision.old_micro_batch,
                              new_micro_batch=decision.new_micro_batch, reason=decision.reason)
            if place.on_cuda:
                forecast.observe(peak_reserved, micro_batch=policy.micro_batch)
                if cap_bytes and forecast.warns(cap_bytes, r.batch.adaptive.shrink_above):
                    predicted = forecast.forecast(1)
                    metrics.event("forecast", state.step, predicted_peak_bytes=int(predicted), cap_bytes=cap_bytes)
                    early = policy.before_step(int(predicted))
                    if early is not None:
                        metrics.event("batch", state.step, old_micro_batch=early.old_micro_batch,
                                      new_micro_batch=early.new_micro_batch, reason=early.reason)
            step_loss = loss_sum / (targets / world)  # this rank's mean; reported from rank 0
            metrics.record("train", state.step, loss=step_loss, lr=scheduler.get_last_lr()[0],
                           tokens=state.tokens, step_time_s=time.perf_counter() - step_start,
                           micro_batch=policy.micro_batch, grad_accum=micro_batches, ooms=ooms,
                           **_memory_fields(place, cap_bytes))
            progress.update(state.step, metrics.last_flushed)
            profiler.step()
            last = state.step == stop_at
            if state.step % r.train.eval_every == 0 or last:
                eval_loss = evaluate(engine, val_loader, val_set, eval_samples, policy.micro_batch, device, world, rank)
                metrics.event("eval", state.step, loss=eval_loss, perplexity=math.exp(min(eval_loss, 50)))
                progress.note_eval(state.step, eval_loss)
                if state.best_eval_loss is None or eval_loss < state.best_eval_loss:
                    state.best_eval_loss = eval_loss
            stopping = interrupted.requested or last
            if save and (state.step % r.train.save_every == 0 or stopping):
                path = save_checkpoint(engine, run_dir, _with_policy(state, policy), rank, r.train.keep_last)
                metrics.event("checkpoint", state.step, path=str(path))
            if interrupted.requested:
                status = "interrupted"
                break
        metrics.flush()
    if status == "done" and state.step < steps_total:
        status = "stopped"
    if status == "done" and save:
        export_model(engine, model, tokenizer, run_dir / "final", rank, zero3)
    metrics.event("run", state.step, event="end", status=status)
    metrics.close()
    loader.close()
    val_loader.close()
    return RunResult(status=status, step=state.step, run_dir=run_dir, final_eval_loss=eval_loss)


class SampleTrace:
    """Test hook: with MEMTRAIN_TRACE_SAMPLES=path, the sample ids whose gradients went into each
    applied optimizer step are appended there (buffered until the step is applied, dropped when an
    OOM discards the step's gradients)."""

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        self.pending: list[list[int]] = []

    @classmethod
    def from_env(cls) -> "SampleTrace":
        import os

        return cls(os.environ.get("MEMTRAIN_TRACE_SAMPLES"))

    def add(self, indices: list[int]) -> None:
        if self.path is not None:
            self.pending.append(list(indices))

    def discard(self) -> None:
        self.pending = []

    def commit(self, step: int, rank: int) -> None:
        if self.path is not None:
            with open(self.path, "a") as handle:
                for indices in self.pending:
                    handle.write(json.dumps({"step": step, "rank": rank, "indices": indices}) + "\n")
        self.pending = []


@functools.lru_cache(maxsize=None)
def _injectors():
    """Test hooks, read once per process so a point that fired stays fired across a restart."""
    from memtrain.train.oom import OomInjector

    return OomInjector.from_env(), OomInjector.from_env("MEMTRAIN_INJECT_OOM_BACKWARD")


def _with_policy(state: LoopState, policy) -> LoopState:
    state.batch_policy = policy.state_dict()
    return state


def _str(path) -> str | None:
    return str(path) if path is not None else None


def _planner_prior(loaded: LoadedRecipe) -> tuple[float, float] | None:
    """The planner's peak as a + b · micro_batch (from plans at micro-batch 1 and 2): the batch
    policy's starting line before it has observed any step."""
    try:
        from memtrain.plan.planner import plan_recipe

        one = plan_recipe(loaded, micro_batch=1).peak_reserved_bytes
        two = plan_recipe(loaded, micro_batch=2).peak_reserved_bytes
    except Exception:  # noqa: BLE001 — without a prior the policy learns from observed peaks
        return None
    slope = max(two - one, 1)
    return float(one - slope), float(slope)


def _planned_peak(loaded: LoadedRecipe) -> int | None:
    try:
        from memtrain.plan.planner import plan_recipe
    except ImportError:
        return None
    try:
        return int(plan_recipe(loaded).peak_reserved_bytes)
    except Exception:  # noqa: BLE001 — the plan is a reference line in reports, never a reason to stop training
        return None


def _memory_fields(place: Place, cap_bytes: int) -> dict:
    import resource

    import psutil

    fields = {"host_rss_bytes": psutil.Process().memory_info().rss,
              "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if place.on_cuda:
        device = place.device
        fields.update(gpu_allocated_bytes=torch.cuda.memory_allocated(device),
                      gpu_reserved_bytes=torch.cuda.memory_reserved(device),
                      gpu_peak_allocated_bytes=torch.cuda.max_memory_allocated(device),
                      gpu_peak_reserved_bytes=torch.cuda.max_memory_reserved(device),
                      gpu_cap_bytes=cap_bytes)
    return fields


def _restart_after_backward_oom(engine, run_dir, state, policy, rank, r, metrics, save, loader, val_loader):
    """ZeRO-1/2 cannot drop a partial gradient: checkpoint the last completed step (with the smaller
    micro-batch in the policy state) and ask the launcher to resume from it."""
    from memtrain.errors import UserError

    if not save:
        raise UserError(Problem(f"out of memory in backward at step {state.step + 1} under ZeRO-1/2, with "
                                "--no-save there is no checkpoint to restart from",
                                hint="lower batch.micro_batch or run without --no-save"))
    path = save_checkpoint(engine, run_dir, _with_policy(state, policy), rank, r.train.keep_last)
    metrics.event("checkpoint", state.step, path=str(path))
    metrics.event("run", state.step, event="end", status="restart")
    metrics.close()
    loader.close()
    val_loader.close()
    return RunResult(status="restart", step=state.step, run_dir=run_dir)
