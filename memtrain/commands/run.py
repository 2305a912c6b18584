"""`memtrain run`: check the recipe and its inputs, resolve the run, train it, say how it ended."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from rich.console import Console

from memtrain.checks.load import load_checked
from memtrain.data.rows.identity import data_files
from memtrain.errors import Problem, UserError
from memtrain.monitor.startup import StartupClock
from memtrain.train.launch import launch, prepare
from memtrain.train.resolve import ResolvedRun, RunOptions
from memtrain.train.runtime.hostfile import (
    NodeCommand,
    check_remote_shell,
    local_command,
    read_hostfile,
    remote_command,
    run_nodes,
)
from memtrain.train.runtime.nodes import DEFAULT_MASTER_PORT, NodeFlags, node_count, rendezvous_for, run_digest
from memtrain.train.runtime.result import RunResult
from memtrain.train.runtime.signals import exit_code, not_saved_line, signum_of, stop_on_signals
from memtrain.train.state.resume import ResumePlan, check_resume, refuse_changed_files
from memtrain.train.state.rundir import FINAL_DIR, RunDirLock, claim_run_dir
from memtrain.train.step.hooks import Hooks


def run_command(
    recipe: Path,
    overrides: list[str],
    options: RunOptions = RunOptions(),
    console: Console | None = None,
    nodes: NodeFlags = NodeFlags(),
) -> int:
    """Train a recipe file on this node; returns the exit code (0 done or stopped, 130 / 143 interrupted by
    SIGINT / SIGTERM, 2 when the nodes do not join or disagree). UserErrors (bad recipe, data, memory, a
    node rank or master missing) are raised before any work starts."""
    console = console or Console(stderr=True)
    try:
        with stop_on_signals():  # until the loop takes over: Ctrl-C / SIGTERM end start-up with a line
            if nodes.hostfile is not None:
                return _run_hostfile(recipe, overrides, options, console, nodes)
            return _run(recipe, overrides, options, console, nodes)
    except KeyboardInterrupt as stop:  # during start-up, or a second Ctrl-C while saving
        console.print(f"[yellow]■[/] {not_saved_line(signum_of(stop))}", highlight=False)
        return exit_code(signum_of(stop))


def _run(recipe: Path, overrides: list[str], options: RunOptions, console: Console, nodes: NodeFlags) -> int:
    clock = StartupClock()  # from this process's start: the `startup` record after the first step
    clock.mark("launch")  # the interpreter, imports and the command line
    count = node_count(nodes, os.environ)  # --nnodes N (or Slurm's allocation) is hardware.nodes=N
    loaded = load_checked(recipe, overrides if count is None else [*overrides, f"hardware.nodes={count}"])
    clock.mark("load_recipe")
    rendezvous = rendezvous_for(loaded.recipe.hardware.nodes, nodes, os.environ)  # before the slow part
    hooks = Hooks.from_env()  # test hooks: the environment is read here, once
    with loaded.sources.located():
        files = data_files(loaded.recipe.data)
    if rendezvous.is_first:  # a changed data file: said now, not after it is tokenised again
        refuse_changed_files(loaded.output_dir, options, loaded.recipe, files)
    prepared = prepare(loaded, hooks, clock, files)
    if rendezvous.nodes > 1:
        console.print(
            f"[dim]·[/] {rendezvous.describe()}, joining within {rendezvous.join_timeout_s} s; "
            f"run {run_digest(prepared.run)} (every node must show the same)",
            highlight=False,
        )
    for note in prepared.notes:
        console.print(f"[dim]·[/] {note}", highlight=False)
    for warning in prepared.warnings:
        console.print(f"[yellow]![/] {warning}", highlight=False)
    with contextlib.ExitStack() as stack:
        if rendezvous.is_first:  # node 0 owns the run directory; the workers check that the others see it
            with loaded.sources.located():  # train.output_dir's file:line
                lock = stack.enter_context(RunDirLock(prepared.run.run_dir))  # one run at a time trains into it
                notes = claim_run_dir(prepared.run.run_dir, options, lock)  # refuses to mix two runs in it
            resuming = check_resume(prepared.run, options)  # refuses a recipe the checkpoint cannot follow
            if finished(prepared.run, resuming):
                console.print(
                    f"[green]✓[/] already trained: {resuming.step} of {prepared.run.total_steps} steps, "
                    f"model in {prepared.run.run_dir / FINAL_DIR}; nothing to do (--overwrite trains it "
                    "again from step 0, the old run moved aside)",
                    highlight=False,
                    soft_wrap=True,
                )
                return 0
            for note in notes + (resuming.lines() if resuming else []):
                console.print(note, highlight=False, soft_wrap=True)

        def report(result: RunResult) -> None:
            mark = "[green]✓[/]" if result.finished else "[yellow]■[/]"
            console.print(f"{mark} {result.summary()}", highlight=False, soft_wrap=True)

        return launch(prepared, options, hooks, report, rendezvous)


def finished(run: ResolvedRun, resuming: ResumePlan | None) -> bool:
    """Whether the run in its directory has done all its steps and saved its model (a resume would redo nothing
    but rebuild the engine and write final/ again)."""
    return resuming is not None and resuming.step >= run.total_steps and (run.run_dir / FINAL_DIR).is_dir()


def _run_hostfile(recipe: Path, overrides: list[str], options: RunOptions, console: Console, nodes: NodeFlags) -> int:
    """DeepSpeed's launcher style: this is the first host of the hostfile; start the per-node `memtrain run` on
    every host (here as node 0, elsewhere through the remote shell) and wait for all of them."""
    assert nodes.hostfile is not None
    if nodes.node_rank is not None:
        raise UserError(
            Problem(
                "--node-rank cannot go with --hostfile: the hostfile's order gives each node its "
                "rank (its first host is this node, node 0)",
                hint="drop --node-rank, or drop --hostfile and run one command per node",
            )
        )
    gpus = load_checked(recipe, overrides).recipe.hardware.gpus
    hosts = read_hostfile(nodes.hostfile, gpus)
    if nodes.nnodes is not None and nodes.nnodes != len(hosts):
        raise UserError(
            Problem(
                f"--nnodes {nodes.nnodes} but the hostfile lists {len(hosts)} hosts",
                file=str(nodes.hostfile),
                hint="drop --nnodes: the hostfile says how many nodes",
            )
        )
    load_checked(recipe, [*overrides, f"hardware.nodes={len(hosts)}"])  # the world must divide the batch, …
    if len(hosts) > 1:
        check_remote_shell(nodes.remote_shell)
    addr = nodes.master_addr or hosts[0].name
    env_port = os.environ.get("MASTER_PORT", "").strip()
    port = nodes.master_port or (int(env_port) if env_port.isdigit() else DEFAULT_MASTER_PORT)
    flags = [
        *options.to_flags(),
        *(["--overwrite"] if options.overwrite else []),
        "--join-timeout",
        str(nodes.join_timeout_s),
        "--nnodes",
        str(len(hosts)),
        "--master-addr",
        addr,
        "--master-port",
        str(port),
    ]
    argv = [["run", str(recipe), *overrides, *flags, "--node-rank", str(rank)] for rank in range(len(hosts))]
    commands = [NodeCommand(hosts[0].name, local_command(argv[0]))]
    commands += [
        NodeCommand(host.name, remote_command(host.name, args, nodes.remote_shell, Path.cwd(), os.environ))
        for host, args in zip(hosts[1:], argv[1:])
    ]
    console.print(
        f"[dim]·[/] {len(hosts)} nodes from {nodes.hostfile}: {hosts[0].name} here (node 0, rendezvous at "
        f"{addr}:{port}), {', '.join(host.name for host in hosts[1:]) or 'no other'} through "
        f"`{nodes.remote_shell}`",
        highlight=False,
        soft_wrap=True,
    )
    return run_nodes(commands)
