"""`memtrain run`: setup → train → save, one readable story.

setup:  process group and device, data (validated before anything is written), model with its
        memory policies, DeepSpeed engine from the compiled config, resume from the newest checkpoint.
train:  for each optimizer step, this rank's share of the global batch in micro-batches sized by the
        batch policy; metrics kept on the device and flushed every `log_every` steps.
save:   periodic atomic checkpoints, a final export in Hugging Face format.
"""
from __future__ import annotations

import json
import math
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from memtrain.errors import DataError
from memtrain.recipe.load import LoadedRecipe
from memtrain.train.checkpoint import LoopState, latest_checkpoint, load_checkpoint
from memtrain.train.distributed import Place, all_reduce_sum, setup_process
from memtrain.train.pinned import exact_pinned_supported
from memtrain.train.oom import injectors_from_env
from memtrain.train.session import SampleTrace, Session
from memtrain.train.step import split, step_targets


@dataclass
class RunResult:
    status: str              # "done" | "stopped" (--max-steps) | "interrupted" | "restart" (OOM in ZeRO-1/2 backward)
    step: int
    run_dir: Path
    final_eval_loss: float | None = None
    exported: Path | None = None   # the Hugging Face export, when one was written


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
          quiet: bool = False, save: bool = True, data=None) -> RunResult:
    """Run a recipe in this process; `data` is prepare_data's result when the caller already has it."""
    r = loaded.recipe
    place, cap_bytes = setup_process(r.hardware.gpu, r.hardware.cap_memory, r.hardware.expandable_segments)
    tokenizer, train_set, val_set = data if data is not None else prepare_data(loaded)
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
    ds_config = compile_recipe(r, micro_batch, steps_total)
    model = build_model(r.model, r.precision.storage, place.device, ds_config, seed=r.train.seed)
    apply_checkpointing(model, r.checkpointing)
    apply_precision(model, r.precision)
    if r.train.compile:
        from memtrain.model.compiled import compile_layers

        compile_layers(model)
    lm = TrainableLM(model, r.precision)
    trainable = [p for p in lm.parameters() if p.requires_grad]
    from memtrain.train.schedule import lr_scheduler_factory

    engine, _, _, scheduler = deepspeed.initialize(model=lm, model_parameters=trainable, config=ds_config,
                                                   optimizer=_client_optimizer(r, trainable),
                                                   lr_scheduler=lr_scheduler_factory(r.schedule, steps_total))
    return engine, scheduler, model, ds_config


def _client_optimizer(r, trainable: list[torch.nn.Parameter]):
    """A bitsandbytes AdamW (8-bit and/or paged states) for DeepSpeed to wrap, or None for the config's AdamW."""
    from memtrain.compile.deepspeed import uses_client_optimizer

    if not uses_client_optimizer(r):
        return None
    from memtrain.model.quantize import require_bitsandbytes

    require_bitsandbytes()
    import bitsandbytes as bnb

    kinds = {"adamw_8bit": bnb.optim.AdamW8bit, "paged_adamw": bnb.optim.PagedAdamW,
             "paged_adamw_8bit": bnb.optim.PagedAdamW8bit}
    o = r.optimizer
    return kinds[o.name](trainable, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)


def _train(loaded, place, cap_bytes, tokenizer, train_set, val_set, steps_total, run_dir, resume, max_steps,
           profile_steps, quiet, save) -> RunResult:
    from memtrain.data.loader import BatchLoader, SampleOrder
    from memtrain.monitor.forecast import PeakForecast
    from memtrain.monitor.metrics import MetricsLog
    from memtrain.monitor.profiler import StepProfiler, phase
    from memtrain.plan.planner import with_resolved_checkpointing
    from memtrain.train.batch_policy import BatchPolicy
    from memtrain.train.export import export_model
    from memtrain.train.oom import start_memory_history
    from memtrain.train.progress import Progress

    r = loaded.recipe
    world, rank, device = place.world_size, place.rank, place.device
    per_rank_batch = r.batch.global_batch // world
    recipe_micro_batch = resolve_micro_batch(loaded)  # "auto" asks the planner
    micro_batch = min(recipe_micro_batch, per_rank_batch)
    loaded = with_resolved_checkpointing(loaded, micro_batch)  # checkpointing "auto" asks the planner too
    r = loaded.recipe
    eval_samples = r.train.eval_batches * recipe_micro_batch  # independent of the GPU count
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
                  micro_batch=policy.micro_batch, plan_peak_reserved_bytes=_planned_peak(loaded),
                  process_started=_process_started(),
                  pinned_sizes="exact" if place.on_cuda and exact_pinned_supported() else "power_of_two")
    order = SampleOrder(len(train_set), r.train.seed)
    loader = BatchLoader(train_set, device)
    val_loader = BatchLoader(val_set, device)
    sample_trace = SampleTrace.from_env()
    forecast = PeakForecast()
    start_memory_history(device)
    profiler = StepProfiler(run_dir, profile_steps, device)
    stop_at = steps_total if max_steps is None else min(steps_total, state.step + max_steps)
    packed = r.data.packing
    interrupted = Interrupted()
    status, eval_loss = "done", None
    progress = Progress(steps_total, enabled=place.is_main and not quiet)

    session = Session(r, place, engine, policy, metrics, forecast, loader, sample_trace, run_dir, zero3, save,
                      state, cap_bytes)
    injectors_from_env()[0].attach(model)  # test hook: OOMs from inside a decoder layer (MEMTRAIN_INJECT_OOM=…@layerK)
    with interrupted.installed(), progress, profiler:
        progress.update(state.step)
        while state.step < stop_at:
            step_start = time.perf_counter()
            samples = order.indices(state.step * r.batch.global_batch, r.batch.global_batch)
            targets = (r.batch.global_batch * (r.data.seq_len - 1)) if packed else step_targets(train_set, samples, device, 1)
            outcome = session.forward_backward(samples[rank * per_rank_batch:(rank + 1) * per_rank_batch], targets)
            if outcome is None:  # an OOM in ZeRO-1/2 backward: saved; the launcher resumes from there
                loader.close()
                val_loader.close()
                return RunResult(status="restart", step=state.step, run_dir=run_dir)
            loss_sum, micro_batches, ooms = outcome
            with phase("optimizer_step"):
                engine.step()
            sample_trace.commit(state.step, rank)
            state.step += 1
            state.tokens += targets
            session.adapt_batch()
            metrics.record("train", state.step, loss=loss_sum / (targets / world), lr=scheduler.get_last_lr()[0],
                           tokens=state.tokens, step_time_s=time.perf_counter() - step_start,
                           micro_batch=policy.micro_batch, grad_accum=micro_batches, ooms=ooms,
                           **_memory_fields(place, cap_bytes), **_loss_scale_fields(engine, r))
            # loss: this rank's mean, reported from rank 0
            progress.update(state.step, metrics.last_flushed)
            profiler.step()
            last = state.step == stop_at
            if state.step % r.train.eval_every == 0 or last:
                eval_loss = evaluate(engine, val_loader, val_set, eval_samples, policy.micro_batch, device, world, rank)
                metrics.event("eval", state.step, loss=eval_loss, perplexity=math.exp(min(eval_loss, 50)))
                progress.note_eval(state.step, eval_loss)
                if state.best_eval_loss is None or eval_loss < state.best_eval_loss:
                    state.best_eval_loss = eval_loss
            if save and (state.step % r.train.save_every == 0 or last or interrupted.requested):
                session.checkpoint()
            if interrupted.requested:
                status = "interrupted"
                break
        metrics.flush()
    if status == "done" and state.step < steps_total:
        status = "stopped"
    exported = None
    if status == "done" and save:
        exported = export_model(engine, model, tokenizer, run_dir / "final", rank, zero3)
    metrics.event("run", state.step, event="end", status=status)
    metrics.close()
    loader.close()
    val_loader.close()
    return RunResult(status=status, step=state.step, run_dir=run_dir, final_eval_loss=eval_loss, exported=exported)


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


def _process_started() -> float:
    """When this process was launched (epoch seconds): the origin of "time to first step"."""
    import psutil

    return psutil.Process().create_time()


def _planned_peak(loaded: LoadedRecipe) -> int | None:
    try:
        from memtrain.plan.planner import plan_recipe
    except ImportError:
        return None
    try:
        return int(plan_recipe(loaded).peak_reserved_bytes)
    except Exception:  # noqa: BLE001 — the plan is a reference line in reports, never a reason to stop training
        return None


def _loss_scale_fields(engine, r) -> dict:
    """fp16: DeepSpeed's current loss scale and the steps its overflow check skipped."""
    if r.precision.compute != "fp16":
        return {}
    scale = getattr(engine.optimizer, "cur_scale", None) or getattr(engine.optimizer, "loss_scale", None)
    return {"loss_scale": float(scale) if scale is not None else None, "skipped_steps": engine.skipped_steps}


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
                      gpu_cap_bytes=cap_bytes,
                      # the allocator hit the cap, freed its cache and retried: slow, a sign to plan lower
                      gpu_alloc_retries=torch.cuda.memory_stats(device).get("num_alloc_retries", 0))
    return fields
