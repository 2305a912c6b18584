"""Launch a run on 1..N processes.

`prepare` checks everything that can be checked before any work, in this process, so bad input fails
fast with exit code 2, no workers and no run directory: the fp16 support of the CPU, the test hooks
against the model, the data, and the host memory the plan predicts. It then resolves the run once
(`run.py`). `launch` trains it: in this process for one GPU (or the CPU) on one node, or with torchrun
for several processes or nodes, each worker reading the resolved run from the run directory
(`memtrain.train.worker`; on nodes other than the first, from a node-local copy). One `launch` per node:
torchrun's rendezvous joins the nodes (`memtrain.train.runtime.nodes`).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch

from memtrain.data.rows.identity import data_files, data_fingerprint
from memtrain.data.rows.loader import densest_row_samples
from memtrain.errors import Problem, UserError
from memtrain.model.architecture import check_attention_kernel
from memtrain.model.attention import packs_steps
from memtrain.model.config import model_architecture
from memtrain.monitor.startup import CLOCK_ENV, StartupClock, bytecode_note
from memtrain.monitor.trackers import tracker_problems
from memtrain.plan.params import count_parameters
from memtrain.recipe.sources import LoadedRecipe
from memtrain.train.loop import train
from memtrain.train.ops.deepspeed_ops import check_buildable, machine_has_gpu
from memtrain.train.progress_bar import tokenising_progress
from memtrain.train.resolve import ResolvedRun, RunOptions, resolve_run, with_model_commit
from memtrain.train.runtime.allocator import exact_pinned_supported
from memtrain.train.runtime.distributed import free_port, usable_cpus
from memtrain.train.runtime.nodes import Rendezvous
from memtrain.train.runtime.preflight import check_dtype, check_memory
from memtrain.train.runtime.result import EXIT_RESTART, RunResult
from memtrain.train.runtime.signals import SAID_DIR_ENV, python_command, run_forwarding_signals, unsaid_stop_line
from memtrain.train.setup import RunData, build_data, setup
from memtrain.train.state.restart_note import read_note
from memtrain.train.step.hooks import Hooks

Report = Callable[[RunResult], None]


@dataclasses.dataclass
class Prepared:
    run: ResolvedRun
    data: RunData  # this process's tokenizer and datasets (workers build their own from the cache)
    warnings: list[str]  # for people: e.g. the plan exceeds the card (the batch policy will adapt)
    notes: list[str] = dataclasses.field(default_factory=list)  # what memtrain chose or found, said once
    clock: StartupClock | None = None  # the start-up phases so far (the command's); setup and the loop go on


def prepare(
    loaded: LoadedRecipe, hooks: Hooks, clock: StartupClock | None = None, files: dict[str, list[str]] | None = None
) -> Prepared:
    """Check what can be checked before anything is built or written, then resolve the run.
    files: the data files' fingerprints (memtrain.data.rows.identity.data_files), when the caller has them already."""
    r = loaded.recipe
    clock = clock or StartupClock()
    check_dtype(loaded)
    trackers = tracker_problems(r.train.report_to)  # not installed, not logged in, out of reach: said now
    if trackers:
        raise loaded.sources.locate(UserError(trackers))
    with loaded.sources.located():
        r = with_model_commit(r)  # a model by Hub id: downloaded (what is missing) and pinned to its commit
    with loaded.sources.located():
        check_buildable(r, machine_has_gpu())  # e.g. async I/O without libaio: said now, not after the model is built
        check_attention_kernel(r.model.attn_implementation, machine_has_gpu())  # flash-attn: a GPU and its package
    notes = list(model_architecture(r.model).notes)
    notes += [note for note in (bytecode_note(),) if note]  # a slow start that is the environment's
    if hooks.oom.layers:  # @layerK points must name layers the model has, before a run directory exists
        hooks.oom.check_layers(count_parameters(r.model).num_layers)
    clock.mark("checks")
    with tokenising_progress(), loaded.sources.located():
        files = files if files is not None else data_files(r.data)
        data = build_data(r)
    fingerprint = data_fingerprint(r.data, data.train_set, data.val_set)  # the cache keys and row layout: no re-read
    clock.mark("data")
    exact_pinned = exact_pinned_supported()
    densest = densest_row_samples(data.train_set)  # the planner prices the attention backward by it
    warnings = [*data.warnings, *check_memory(loaded, exact_pinned, densest)]  # the data's own (render.py), then memory
    with loaded.sources.located():
        run = resolve_run(
            r,
            loaded.name,
            loaded.output_dir,
            len(data.train_set),
            exact_pinned,
            data_fingerprint=fingerprint,
            data_files=files,
            densest_row_samples=densest,
        )
    clock.mark("plan")
    if r.batch.micro_batch == "auto":  # the default: the size is the planner's, for the recipe's card
        steps = run.per_rank_batch // run.micro_batch
        why = (
            "the whole batch, as optimizer.step_in_backward needs"
            if r.optimizer.step_in_backward
            else f"the largest that divides the {run.per_rank_batch} samples per GPU and step and fits {r.hardware.gpu}"
        )
        notes.append(
            f"micro-batch {run.micro_batch} (batch.micro_batch auto: {why}; {steps} "
            f"micro-batch{'es' if steps != 1 else ''} per step)"
        )
    if not r.data.is_text:  # instruction and chat data: what truncation, packing and masking made of it
        cut = (
            "; each step's samples are laid end to end into packed micro-batches, kept apart by the varlen "
            "attention (`memtrain plan --data` says the padding computed)"
            if packs_steps(r)
            else "; length-bucketed micro-batches are cut to their longest row, so less padding is computed "
            "(`memtrain plan --data` says how much)"
            if r.data.groups_by_length
            else ""
        )
        notes.append(f"training data: {data.train_set.stats.describe()}{cut}")
    if data.added_tokens:
        notes.append(added_tokens_note(data.added_tokens, len(data.tokenizer), data.model_embedding_rows))
    return Prepared(run, data, warnings, notes, clock)


def added_tokens_note(added: tuple[str, ...], tokenizer_rows: int, model_rows: int) -> str:
    """What adding a template's markers does to the model: its embeddings grow only where the tokenizer outgrows
    them (model/build.py); a model with spare rows (a vocabulary padded to a multiple of 64) keeps its size."""
    first_id = tokenizer_rows - len(added)
    if tokenizer_rows > model_rows:
        return (
            f"added {', '.join(added)} to the tokenizer; the model's embeddings grow from {model_rows} to "
            f"{tokenizer_rows} rows and the new ones are trained"
        )
    return (
        f"added {', '.join(added)} to the tokenizer as ids {first_id}-{tokenizer_rows - 1}, rows the model's "
        f"{model_rows}-row embeddings already have (its size is kept); they are trained"
    )


def train_here(
    run: ResolvedRun, options: RunOptions, hooks: Hooks, data: RunData | None = None, clock: StartupClock | None = None
) -> RunResult:
    """Set up and train in this process; every resource setup took is released when it returns or raises.
    clock: the start-up phases so far (None: a clock from this process's start)."""
    with ExitStack() as stack:
        return train(setup(run, options, hooks, stack, data, clock))


def launch(
    prepared: Prepared, options: RunOptions, hooks: Hooks, report: Report, rendezvous: Rendezvous = Rendezvous.alone()
) -> int:
    """Train a prepared run on this node; returns the process exit code (0 done or stopped, 130 / 143
    interrupted by SIGINT / SIGTERM, which reach every worker: memtrain.train.runtime.signals; 2 when the nodes
    do not join within the rendezvous timeout or do not agree on the run)."""
    run = prepared.run
    hw = run.recipe.hardware
    if hw.world_size == 1:
        result = train_here(run, options, hooks, prepared.data, prepared.clock)
        while result.status == "restart":  # an OOM in ZeRO-1/2 backward: saved; resume smaller
            _release()
            options = dataclasses.replace(options, resume=True, max_steps=result.max_steps_left)
            result = train_here(run, options, hooks, prepared.data)
        report(result)
        return result.exit_code
    _check_devices(hw.gpus)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, usable_cpus() // hw.gpus))))
    if prepared.clock is not None:  # the workers' start-up record begins at this command, as one process's does
        env[CLOCK_ENV] = prepared.clock.to_env()
    with tempfile.TemporaryDirectory(prefix="memtrain-node-") as local:
        run_file = run.save(None if rendezvous.is_first else Path(local))
        while True:
            # one node: a fresh local port each attempt; several: the agreed master port, where node 0's
            # next torchrun hosts the rendezvous again
            meet = rendezvous if rendezvous.nodes > 1 else dataclasses.replace(rendezvous, master_port=free_port())
            said = tempfile.mkdtemp(dir=local, prefix="said-")  # a problem every worker meets is printed once
            code = run_forwarding_signals(
                torchrun_command(hw.gpus, meet, [str(run_file), *options.to_flags()]), {**env, SAID_DIR_ENV: said}
            )
            line = unsaid_stop_line(Path(said), code)  # stopped before rank 0 (on the first node) could say so
            if line and rendezvous.is_first:
                print(line, file=sys.stderr)
            if code != EXIT_RESTART:
                return code
            note = read_note(run.run_dir)  # what the process that ran out of memory left (restart_note.py)
            options = dataclasses.replace(
                options, resume=True, max_steps=note.max_steps_left if note is not None else options.max_steps
            )
            env.pop(CLOCK_ENV, None)  # a restart's first step is no start-up of the command's


def torchrun_command(nproc: int, rendezvous: Rendezvous, worker_args: list[str]) -> list[str]:
    """The torchrun command line that starts `nproc` workers on this node and joins the others at the
    rendezvous (torchrun dying with its launcher)."""
    return [
        *python_command("memtrain.train.runtime.signals"),
        f"--nproc_per_node={nproc}",
        *rendezvous.torchrun_flags(),
        "--no-python",
        *python_command("memtrain.train.worker"),
        *worker_args,
    ]


def _release() -> None:
    """Free the previous attempt's engine before building a new one."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _check_devices(gpus: int) -> None:
    available = torch.cuda.device_count()
    if available and available < gpus:
        raise UserError(
            Problem(
                f"the recipe asks for {gpus} GPUs but this machine has {available}",
                key="hardware.gpus",
                hint=f"set hardware.gpus={available}",
            )
        )
