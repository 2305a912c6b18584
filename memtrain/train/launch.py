"""Launch a run on 1..N processes.

The recipe and its data are checked in this process first, so bad input fails fast with exit code
2 and no workers start. One process runs in-process; several are started with torchrun (one per
GPU, or per CPU rank with gloo when there is no GPU), each running `memtrain.train.worker`.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from memtrain.recipe.load import load_recipe

EXIT_INTERRUPTED = 130
WORKER_ENV = "MEMTRAIN_WORKER"
EXIT_RESTART = 75  # a worker saved after an OOM it could not recover in place; start again from there


def torchrun_command(nproc: int, port: int, worker_args: list[str]) -> list[str]:
    """The torchrun command line that starts `nproc` workers on this host."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            "--nnodes=1", "--master_addr=127.0.0.1", f"--master_port={port}",
            "-m", "memtrain.train.worker", *worker_args]


def launch(recipe: Path, overrides: list[str], resume: bool = True, max_steps: int | None = None,
           profile_steps: int = 0, save: bool = True) -> int:
    """Run a recipe; returns the process exit code (0 done, 130 interrupted)."""
    loaded = load_recipe(recipe, overrides)
    gpus = loaded.recipe.hardware.gpus
    already_launched = os.environ.get(WORKER_ENV) == "1"  # a worker torchrun started for this launcher
    if gpus == 1 or already_launched:
        from memtrain.train.loop import train

        # workers started by torchrun were checked by their launcher
        data = None if already_launched else _preflight(loaded)
        result = train(loaded, resume=resume, max_steps=max_steps, profile_steps=profile_steps, save=save, data=data)
        while result.status == "restart" and gpus == 1:  # an OOM in ZeRO-1/2 backward: resume smaller
            _release(result)
            result = train(loaded, resume=True, max_steps=max_steps, profile_steps=profile_steps, save=save,
                           data=data)
        _print_result(result)
        if result.status == "restart":
            return EXIT_RESTART
        return EXIT_INTERRUPTED if result.status == "interrupted" else 0
    _check_devices(gpus)
    from memtrain.train.distributed import free_port

    _preflight(loaded)  # data and memory problems surface here, once, before any worker starts
    args = [str(recipe), *overrides, "--resume" if resume else "--no-resume"]
    if max_steps is not None:
        args += ["--max-steps", str(max_steps)]
    if profile_steps:
        args += ["--profile", str(profile_steps)]
    if not save:
        args.append("--no-save")
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // gpus))),
               **{WORKER_ENV: "1"})
    while True:
        completed = subprocess.run(torchrun_command(gpus, free_port(), args), env=env)
        if completed.returncode != EXIT_RESTART:
            return completed.returncode
        args = [a for a in args if a != "--no-resume"] + ["--resume"]


def _preflight(loaded):
    """Data and host memory are checked before anything is built; GPU fit is a warning.
    Returns the prepared data (tokenizer, train and validation sets) for this process to train on."""
    from rich.console import Console

    from memtrain.train.loop import prepare_data
    from memtrain.train.preflight import check_dtype, check_memory

    check_dtype(loaded)
    _check_test_hooks(loaded)
    data = prepare_data(loaded)
    for warning in check_memory(loaded):
        Console(stderr=True).print(f"[yellow]![/] {warning}", highlight=False)
    return data


def _check_test_hooks(loaded) -> None:
    """MEMTRAIN_INJECT_OOM's layer points must name layers the model has, before a run dir exists."""
    from memtrain.train.oom import injectors_from_env

    injector = injectors_from_env()[0]
    if injector.layers:
        from memtrain.plan.params import count_parameters

        injector.check_layers(count_parameters(loaded.recipe.model).num_layers)


def _release(result) -> None:
    """Free the previous attempt's engine before building a new one."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _check_devices(gpus: int) -> None:
    import torch

    from memtrain.errors import Problem, UserError

    available = torch.cuda.device_count()
    if available and available < gpus:
        raise UserError(Problem(f"the recipe asks for {gpus} GPUs but this machine has {available}",
                                key="hardware.gpus", hint=f"set hardware.gpus={available}"))


def _print_result(result) -> None:
    from rich.console import Console

    console = Console(stderr=True)
    if result.status == "done":
        where = f"model in {result.exported}" if result.exported else f"metrics in {result.run_dir} (--no-save)"
        console.print(f"[green]✓[/] trained {result.step} steps; {where}")
    elif result.status == "restart":
        console.print(f"[yellow]■[/] out of memory in backward at step {result.step + 1}; saved, restarting smaller")
    elif result.status == "stopped":
        console.print(f"[yellow]■[/] stopped at step {result.step} as asked (--max-steps); checkpoint in "
                      f"{result.run_dir / 'checkpoints'} — run without --max-steps to continue")
    else:
        console.print(f"[yellow]■[/] interrupted at step {result.step}; checkpoint in "
                      f"{result.run_dir / 'checkpoints'} — run the same command again to resume")
