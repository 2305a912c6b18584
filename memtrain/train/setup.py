"""Everything a run needs before its first step, built by public builders into one `Training` object.

    data     = build_data(recipe)                       tokenizer, train and validation sets
    model    = build_policy_model(recipe, place, cfg)   the model with its memory policies applied
    engine   = build_engine(recipe, model, cfg, steps)  DeepSpeed's engine, optimizer and LR schedule
    training = setup(run, options, hooks, stack)        all of it, resumed, with the loop's helpers

`setup` registers every clean-up (prefetch threads, the metrics log) on the caller's ExitStack, so
an exception anywhere in setup or training releases them. Scripts and tests use the same builders.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from memtrain.configs import model_preset, model_preset_names
from memtrain.data.render.chat import generation_prompt_warning, unclosed_turn_warning
from memtrain.data.render.templates import ensure_template_tokens
from memtrain.data.rows.dataset import build_datasets
from memtrain.data.rows.loader import BatchLoader, SampleOrder, sample_order
from memtrain.data.rows.mixture import (
    noted_datasets,
    trailing_turns_warning,
    unread_system_warning,
    untrainable_records_warning,
    unwritten_messages_warning,
)
from memtrain.data.rows.overlap import HeldOutOverlap, overlap_warning
from memtrain.data.rows.pairs import identical_pairs_warning, pair_truncation_warning
from memtrain.data.rows.row_set import SampleRows
from memtrain.data.tokens.tokenizer import load_tokenizer
from memtrain.ds_config.compiler import ds_config as compile_ds_config
from memtrain.ds_config.compiler import uses_client_optimizer
from memtrain.errors import DataError, Problem, UserError
from memtrain.files import write_atomically
from memtrain.model.attention import packs_steps
from memtrain.model.build import build_model
from memtrain.model.compiled import compile_layers
from memtrain.model.config import meta_model, model_config
from memtrain.model.kernels import apply_liger_kernels, patches_layers, uses_fused_loss
from memtrain.model.loraplus import lora_param_groups
from memtrain.model.precision import apply_precision
from memtrain.model.preference import PreferenceLM, reference_of
from memtrain.model.preference_loss import PreferenceSettings
from memtrain.model.quantize import require_bitsandbytes
from memtrain.model.recompute import apply_checkpointing
from memtrain.model.tiled_mlp import apply_mlp_tiles
from memtrain.model.wrapper import TrainableLM
from memtrain.monitor.forecast import PeakForecast
from memtrain.monitor.metrics import MetricsLog
from memtrain.monitor.profiler import StepProfiler
from memtrain.monitor.startup import StartupClock
from memtrain.monitor.trackers import open_trackers
from memtrain.recipe.schema import Recipe
from memtrain.train.eval.generation import GenerationEval
from memtrain.train.ops.cpu_adam import CpuAdamLoad
from memtrain.train.optim.grad_norm import fuse_grad_norm
from memtrain.train.optim.in_backward import StepInBackward
from memtrain.train.optim.overflow_scan import fuse_overflow_scan
from memtrain.train.optim.schedule import lr_scheduler_factory
from memtrain.train.resolve import ResolvedRun, RunOptions, max_steps_stop
from memtrain.train.runtime.distributed import Place, setup_process
from memtrain.train.runtime.nodes import agree_on_run
from memtrain.train.runtime.oom import start_memory_history
from memtrain.train.state.checkpoint import LoopState, latest_checkpoint, load_checkpoint
from memtrain.train.state.frozen_base import base_key
from memtrain.train.state.reference import load_or_compute
from memtrain.train.state.restart_note import RestartNote, read_note
from memtrain.train.state.resume import follow_recipe, optimizer_settings, recipe_json
from memtrain.train.state.rundir import start_metrics
from memtrain.train.step.batch_policy import BatchPolicy
from memtrain.train.step.hooks import Hooks
from memtrain.train.step.runner import StepRunner


@dataclass
class RunData:
    tokenizer: object
    train_set: torch.utils.data.Dataset
    val_set: torch.utils.data.Dataset
    added_tokens: tuple[str, ...]  # a chat template's markers added to the tokenizer (data.add_special_tokens)
    model_embedding_rows: int  # the model's own vocabulary (config.vocab_size), before any growth
    warnings: tuple[str, ...] = ()  # for people, said by whatever builds the data (run, prepare, preview)

    @property
    def model_vocab_size(self) -> int | None:
        """The vocabulary the model must grow to, when tokens were added; None keeps the model's own."""
        return len(self.tokenizer) if self.added_tokens else None


def build_data(recipe: Recipe) -> RunData:
    """Tokenizer and datasets, checked against the model and the global batch. Problems name their
    recipe key (a caller holding the recipe's Sources adds file:line)."""
    tokenizer = load_tokenizer(recipe.model)
    added = tuple(ensure_template_tokens(recipe.data, tokenizer))
    if added:
        check_new_rows_train(recipe, added)
    vocab_size = model_config(recipe.model).vocab_size
    if len(tokenizer) - len(added) > vocab_size:
        needed = len(tokenizer) - len(added)
        fitting = sorted(
            (model_preset(name)["vocab_size"], name)
            for name in model_preset_names()
            if model_preset(name).get("vocab_size", 0) >= needed
        )
        closest = [name for vocab, name in fitting if vocab == fitting[0][0]][:4] if fitting else []  # least padding
        presets = f" ({' or '.join(f'model.preset={name}' for name in closest)}: {fitting[0][0]:,})" if closest else ""
        raise DataError(
            Problem(
                f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary has {vocab_size}",
                key="model.tokenizer",
                hint="use the model's own tokenizer, or a preset whose vocab_size is at least the tokenizer's"
                f"{presets}",
            )
        )
    train_set, val_set = build_datasets(recipe.data, tokenizer, recipe.train.seed)
    if len(train_set) < recipe.batch.global_batch:
        raise DataError(
            Problem(
                f"the training data gives {len(train_set)} {recipe.data.item_name} of {recipe.data.seq_len} tokens, "
                f"fewer than one global batch of {recipe.batch.global_batch}"
                + (
                    f" ({train_set.stats.samples} samples packed into them: batch.global_batch counts rows)"
                    if recipe.data.item_name == "packed rows"
                    else ""
                ),
                key="batch.global_batch",
                hint="add data, lower data.seq_len, or lower batch.global_batch"
                + (
                    " (or set data.packing: false: one sample per row)"
                    if recipe.data.item_name == "packed rows"
                    else ""
                ),
            )
        )
    noted = noted_datasets(recipe.data, tokenizer)  # the token cache's notes, read once for the four below
    warnings = (
        unclosed_turn_warning(recipe.data, tokenizer),  # a template that leaves nothing to stop at,
        generation_prompt_warning(recipe.data, tokenizer),  # prompts otherwise than it trains,
        unwritten_messages_warning(recipe.data, tokenizer, noted),  # or leaves messages out,
        trailing_turns_warning(recipe.data, tokenizer, noted),  # conversations that go on past their answer,
        untrainable_records_warning(recipe.data, tokenizer, noted),  # records left out with nothing to train on,
        unread_system_warning(recipe.data, tokenizer, noted),  # or a system prompt the dataset does not read;
        pair_truncation_warning(train_set),  # preference pairs cut to seq_len or left out for it,
        identical_pairs_warning(noted),  # or with the same answer on both sides;
        overlap_warning(_held_out_overlap(val_set), recipe.data.validation_dedup),  # held-out prompts trained on
    )
    return RunData(tokenizer, train_set, val_set, added, vocab_size, tuple(w for w in warnings if w))


def _held_out_overlap(val_set) -> HeldOutOverlap | None:
    """What the validation rows share with training (mixture.py counts it for lists of conversation datasets)."""
    return val_set.stats.held_out if isinstance(val_set, SampleRows) else None


def check_new_rows_train(recipe: Recipe, added: tuple[str, ...]) -> None:
    """Added tokens get new embedding rows that start random: with LoRA they train only when the embeddings
    and the output head are in model.lora.modules_to_save (read from the model's structure, not Llama names)."""
    lora = recipe.model.lora
    if lora is None:
        return
    model = meta_model(recipe.model)
    names = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if module is model.get_input_embeddings() or module is model.get_output_embeddings()
    }
    missing = sorted(names - set(lora.modules_to_save))
    if missing:
        raise UserError(
            Problem(
                f"{', '.join(added)} are added to the tokenizer, but LoRA would leave their new embedding rows "
                "untrained",
                key="model.lora.modules_to_save",
                hint=f"add {missing} to model.lora.modules_to_save, or use a tokenizer that has the template's markers",
            )
        )


def build_policy_model(recipe: Recipe, place: Place, ds_config: dict, vocab_size: int | None = None) -> torch.nn.Module:
    """The causal LM on its device with the recipe's checkpointing, precision map and compiled layers
    (its embeddings grown to `vocab_size` when tokens were added to the tokenizer), built from Liger's
    modules when `model.kernels` resolved to liger (not liger_loss: its loss is chosen in build_engine)."""
    if patches_layers(recipe.model):
        apply_liger_kernels(recipe.model)  # transformers' module-level classes: before the model is built
    model = build_model(
        recipe.model, recipe.precision.storage, place.device, ds_config, seed=recipe.train.seed, vocab_size=vocab_size
    )
    if recipe.train.compile is True:  # resolved (memtrain.train.resolve); an unresolved 'auto' builds eager layers
        # first: the checkpoint wraps the compiled layer, it is not traced inside it
        compile_layers(
            model,
            cuda_graphs=recipe.train.cuda_graphs is True,
            memory_budget=recipe.checkpointing.compiled_memory_budget,
        )
    apply_checkpointing(model, recipe.checkpointing)
    apply_mlp_tiles(model, recipe.checkpointing)
    apply_precision(model, recipe.precision)
    return model


def build_engine(recipe: Recipe, model: torch.nn.Module, ds_config: dict, total_steps: int):
    """(DeepSpeed engine, LR scheduler) around the model with memtrain's loss."""
    import deepspeed  # noqa: PLC0415 — heavy (and it sets up its accelerator on import): only where an engine is built

    lm = training_module(recipe, model)
    trainable = [p for p in lm.parameters() if p.requires_grad]
    lora, o = recipe.model.lora, recipe.optimizer
    # LoRA+: the B matrices at lr × ratio, as parameter groups that every optimizer (and the schedule) keeps apart
    groups = (
        lora_param_groups(lm, o.lr, lora.loraplus_lr_ratio, o.weight_decay)
        if lora is not None and lora.loraplus_lr_ratio is not None
        else trainable
    )
    engine, _, _, scheduler = deepspeed.initialize(
        model=lm,
        model_parameters=groups,
        config=ds_config,
        optimizer=client_optimizer(recipe, groups),
        lr_scheduler=lr_scheduler_factory(recipe.schedule, total_steps),
    )
    fuse_overflow_scan(engine)  # ZeRO-1/2: one multi-tensor scan for inf/NaN gradients, not one per tensor
    fuse_grad_norm(engine)  # ZeRO-1/2: the clipping norm by one multi-tensor kernel, not one per tensor
    if o.step_in_backward:
        # after each backward DeepSpeed's ZeRO-0 all-reduce gives every parameter without a gradient a zero one: the
        # whole model's gradients, which the hooks had just freed (measured: 7B at 22.6 GiB allocated, 16.8 planned)
        engine.enable_backward_allreduce = False
    return engine, scheduler


def training_module(recipe: Recipe, model: torch.nn.Module) -> torch.nn.Module:
    """What DeepSpeed trains: the causal LM with memtrain's loss, TrainableLM for SFT, PreferenceLM for a preference
    objective (train.objective), both returning (loss sum, what the step divides it by)."""
    if recipe.train.objective != "sft":
        return PreferenceLM(model, recipe.precision, PreferenceSettings.of(recipe), reference_of(recipe))
    return TrainableLM(
        model, recipe.precision, fused_loss=uses_fused_loss(recipe.model, recipe.precision, recipe.zero_stage)
    )


def attach_reference(recipe: Recipe, module: PreferenceLM, data: RunData, place, micro_batch: int) -> None:
    """preference.reference precomputed: the initial model's log-probabilities of the training and validation
    pairs, read from beside the token cache or computed now (train/state/reference.py), carried by the sets'
    batches from here on. Called before any checkpoint is loaded: the pass must see the initial weights."""
    trim = recipe.data.groups_by_length
    pack = packs_steps(recipe)  # as training lays the pairs out
    for name in ("train_set", "val_set"):
        dataset = getattr(data, name)
        with BatchLoader(dataset, place.device, trim=trim, pack_steps=pack) as loader:
            table = load_or_compute(recipe, module, loader, dataset, micro_batch=micro_batch, place=place)
        setattr(data, name, dataset.with_reference(table))


def client_optimizer(recipe: Recipe, trainable: list[torch.nn.Parameter] | list[dict]):
    """The optimizer DeepSpeed is handed: a bitsandbytes AdamW (8-bit and/or paged states), one optimizer per
    parameter stepped during backward (optimizer.step_in_backward), or None for the config's AdamW."""
    if not uses_client_optimizer(recipe):
        return None
    o = recipe.optimizer
    settings = {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}
    if o.name == "adamw":
        kind = torch.optim.AdamW
    else:
        require_bitsandbytes()
        import bitsandbytes as bnb  # noqa: PLC0415 — optional dependency (memtrain[qlora])

        kind = {
            "adamw_8bit": bnb.optim.AdamW8bit,
            "paged_adamw": bnb.optim.PagedAdamW,
            "paged_adamw_8bit": bnb.optim.PagedAdamW8bit,
        }[o.name]
    if o.step_in_backward:
        return StepInBackward(trainable, settings, make=kind)  # each parameter's group carries the settings
    return kind(trainable, **settings)


@dataclass
class Training:
    """One run, set up: what the loop reads and drives."""

    run: ResolvedRun
    options: RunOptions
    hooks: Hooks
    place: Place
    cap_bytes: int
    data: RunData
    model: torch.nn.Module
    engine: object
    scheduler: object
    state: LoopState
    resumed_from: Path | None
    order: SampleOrder
    loader: BatchLoader
    val_loader: BatchLoader
    metrics: MetricsLog
    profiler: StepProfiler
    stepper: StepRunner
    generation: GenerationEval | None = None  # train.eval_generate, on rank 0
    startup: StartupClock | None = None  # the start-up phases; the loop adds the first step and records them
    restarted_after: RestartNote | None = None  # the OOM this attempt starts smaller after (restart_note.py)

    @property
    def recipe(self) -> Recipe:
        return self.run.recipe


def setup(
    run: ResolvedRun,
    options: RunOptions,
    hooks: Hooks,
    stack: ExitStack,
    data: RunData | None = None,
    clock: StartupClock | None = None,
) -> Training:
    """Process group and device, data, model, engine, resume, loaders and logs, for this process's rank.
    clock: the start-up phases so far (None: a clock from this process's start, as in a torchrun worker)."""
    r = run.recipe
    clock = clock or StartupClock()
    clock.mark("checks")  # what came before (the run directory, resume checks; a worker's own start)
    place, cap_bytes = setup_process(r.hardware.gpu, r.hardware.cap_memory, r.hardware.expandable_segments)
    cpu_adam = CpuAdamLoad(r).start()  # built or loaded while the data and the model are built
    clock.mark("process")
    agree_on_run(run, options, place)  # every node runs the same recipe, into a run directory all of them see
    data = data or build_data(r)
    clock.mark("data")
    run.run_dir.mkdir(parents=True, exist_ok=True)
    ds_config = compile_ds_config(r, run.micro_batch)
    model = build_policy_model(r, place, ds_config, data.model_vocab_size)
    clock.mark("model")
    cpu_adam.wait()  # before deepspeed.initialize, which then finds the op loaded
    clock.mark("cpu_adam_op")  # what is left of its build or load when the model is ready
    engine, scheduler = build_engine(r, model, ds_config, run.total_steps)
    clock.mark("deepspeed_init")  # includes the pinned host buffers of an offloaded optimizer
    hooks.wait_slow_start()  # MEMTRAIN_INJECT_SLOW_START: this rank still starting while the others train

    if isinstance(engine.module, PreferenceLM) and engine.module.reference == "precomputed":
        attach_reference(r, engine.module, data, place, run.micro_batch)
        clock.mark("reference")  # the reference pass, or reading its stored log-probabilities
    state, checkpoint = LoopState(), latest_checkpoint(run.run_dir) if options.resume else None
    if checkpoint is not None:
        built = optimizer_settings(engine, scheduler)  # the recipe's; the checkpoint brings the old ones
        state = load_checkpoint(engine, checkpoint, place.rank, base_key=base_key(r.model))
        follow_recipe(engine, scheduler, state, r, built)
    policy = BatchPolicy(
        r.batch, run.per_rank_batch, run.micro_batch, cap_bytes or 1, prior=run.planner_prior if place.on_cuda else None
    )
    if state.batch_policy:
        policy.load_state_dict(state.batch_policy)
    if place.is_main:
        start_metrics(run.run_dir, state.step if checkpoint is not None else None)  # one history per directory
        run.save()
        write_atomically(run.run_dir / "ds_config.json", json.dumps(ds_config, indent=2))
        write_atomically(run.run_dir / "recipe.json", r.model_dump_json(indent=2))

    metrics = MetricsLog(
        run.run_dir / "metrics.jsonl",
        flush_every=r.train.log_every,
        enabled=place.is_main,
        trackers=open_trackers(r.train.report_to, run.run_dir, run.name, recipe_json(r), run.figures())
        if place.is_main
        else (),
    )
    stack.callback(metrics.close)
    note = read_note(run.run_dir) if options.resume else None
    if note is not None and note.applies_to(state.step):  # another process ran out of memory in backward: smaller
        policy.restarted_after_oom(note.failed_micro_batch, note.micro_batch)
    else:
        note = None
    trim = r.data.groups_by_length  # micro-batches cut to their longest row (data/rows/loader.py)
    pack = packs_steps(r)  # or laid out packed within the step
    loader = stack.enter_context(BatchLoader(data.train_set, place.device, trim=trim, pack_steps=pack))
    val_loader = stack.enter_context(BatchLoader(data.val_set, place.device, trim=trim, pack_steps=pack))
    start_memory_history(place.device)
    hooks.oom.attach(model)  # OOMs from inside a decoder layer (MEMTRAIN_INJECT_OOM=…@layerK)
    hooks.nan.attach(model)  # NaN losses (MEMTRAIN_INJECT_NAN)
    clock.mark("loaders")  # resume, metrics, data loaders
    stepper = StepRunner(
        r=r,
        place=place,
        engine=engine,
        policy=policy,
        metrics=metrics,
        forecast=PeakForecast(),
        loader=loader,
        hooks=hooks,
        run_dir=run.run_dir,
        zero3=r.zero_stage == 3,
        save=options.save,
        state=state,
        cap_bytes=cap_bytes,
        max_steps_stop=max_steps_stop(options, state.step),
    )
    return Training(
        run=run,
        options=options,
        hooks=hooks,
        place=place,
        cap_bytes=cap_bytes,
        data=data,
        model=model,
        engine=engine,
        scheduler=scheduler,
        state=state,
        resumed_from=checkpoint,
        order=sample_order(r.data, data.train_set, r.train.seed, r.batch.global_batch, pack_steps=pack),
        loader=loader,
        val_loader=val_loader,
        metrics=metrics,
        profiler=StepProfiler(run.run_dir, options.profile_steps, place.device),
        stepper=stepper,
        generation=GenerationEval.for_run(r, data.tokenizer, place.is_main),
        startup=clock,
        restarted_after=note,
    )
