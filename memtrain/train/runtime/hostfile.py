"""One command on the first node, DeepSpeed's launcher style: `memtrain run RECIPE --hostfile FILE`.

The hostfile is DeepSpeed's: one `host slots=N` line per machine, `#` comments, the first line this
machine. memtrain reimplements no rendezvous here either: it starts, on every host, the same per-node
`memtrain run … --nnodes N --node-rank R --master-addr FIRST --master-port P` that one would type by hand
(docs/MULTINODE.md) — on the first host as a local process (node 0), on the others through a remote shell
(`ssh HOST 'cd DIR && exec … python -m memtrain run …'`, like `deepspeed --launcher ssh`). Then it streams
every node's output prefixed with its host, forwards SIGINT / SIGTERM (node 0 gets the signal, whose
workers agree with the others' to save at the same step; the remote shells are signalled too), stops the
other nodes when one fails, and exits with the worst code of all nodes.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from memtrain.errors import Problem, UserError
from memtrain.train.runtime.signals import STOP_SIGNALS, exit_code

DEFAULT_REMOTE_SHELL = "ssh"
# what a remote node needs from this one's environment (ssh starts a fresh one): DeepSpeed's launcher
# exports NCCL*, PYTHON* and the like the same way; rank and master variables never (the flags say them)
EXPORTED_ENV_PREFIXES = ("NCCL_", "PYTHON", "HF_", "TRANSFORMERS_", "MEMTRAIN_", "OMP_NUM_THREADS", "GLOO_")
_LINE = re.compile(r"^(?P<host>\S+)(?:\s+slots\s*=\s*(?P<slots>\S+))?\s*$")


@dataclass(frozen=True)
class Host:
    name: str
    slots: int
    line: int


def read_hostfile(path: Path, gpus: int) -> list[Host]:
    """The hosts of a DeepSpeed hostfile, first one first. Every line `host slots=N` with N equal to the
    recipe's hardware.gpus (memtrain starts the same processes on every node); raises UserError naming
    file:line for a malformed line, another slots count, a host given twice, or a file with no host."""
    try:
        text = path.read_text()
    except OSError as error:
        raise UserError(
            Problem(
                f"cannot read the hostfile: {error.strerror or error}",
                file=str(path),
                hint="pass --hostfile with the path of a file of `host slots=N` lines",
            )
        ) from None
    hosts: list[Host] = []
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.match(line)
        slots = match and match["slots"]
        if not match or slots is None or not slots.isdigit() or int(slots) < 1:
            problems.append(
                Problem(
                    f"cannot read {raw.strip()!r} as a host line",
                    file=str(path),
                    line=number,
                    hint="write one machine per line as `HOST slots=N` (N ≥ 1, the GPUs it runs), comments after #",
                )
            )
            continue
        name = match["host"]
        if name in seen:
            problems.append(
                Problem(
                    f"host {name} is listed twice (first on line {seen[name]})",
                    file=str(path),
                    line=number,
                    hint="list each machine once; its slots say how many processes it runs",
                )
            )
            continue
        seen[name] = number
        if int(slots) != gpus:
            problems.append(
                Problem(
                    f"host {name} has slots={slots} but the recipe runs hardware.gpus={gpus} processes on every node",
                    file=str(path),
                    line=number,
                    hint=f"write slots={gpus} on every line, or set hardware.gpus={slots} "
                    "if every machine has that many (memtrain runs the same number of processes on each node)",
                )
            )
            continue
        hosts.append(Host(name, int(slots), number))
    if not problems and not hosts:
        problems.append(
            Problem(
                "the hostfile names no host",
                file=str(path),
                hint="write one `HOST slots=N` line per machine, this machine first",
            )
        )
    if problems:
        raise UserError(problems)
    return hosts


@dataclass(frozen=True)
class NodeCommand:
    """What to start for one node, and the host name its output lines are prefixed with."""

    host: str
    argv: list[str]


def local_command(argv: list[str]) -> list[str]:
    """Node 0's `memtrain run …`, started here by this interpreter."""
    return [sys.executable, "-m", "memtrain", *argv]


def remote_command(host: str, argv: list[str], remote_shell: str, cwd: Path, env: Mapping[str, str]) -> list[str]:
    """`REMOTE_SHELL HOST 'cd CWD && exec env K=V… PYTHON -m memtrain ARGV'`: the same interpreter, working
    directory and arguments on the other host (which must have them at the same paths, as with DeepSpeed)."""
    exported = [f"{key}={value}" for key, value in sorted(env.items()) if key.startswith(EXPORTED_ENV_PREFIXES)]
    words = ["exec", *(["env", *exported] if exported else []), *local_command(argv)]
    script = f"cd {shlex.quote(str(cwd))} && {shlex.join(words)}"
    return [*shlex.split(remote_shell), host, script]


def check_remote_shell(remote_shell: str) -> None:
    """The remote shell's program must exist here, before any node starts."""
    words = shlex.split(remote_shell)
    if not words or shutil.which(words[0]) is None:
        raise UserError(
            Problem(
                f"cannot find the remote shell {remote_shell!r} that starts the other nodes",
                hint='install ssh, or pass --remote-shell with a command that takes HOST COMMAND (e.g. "ssh -p 2222")',
            )
        )


def run_nodes(nodes: list[NodeCommand], out: IO[str] | None = None, poll_s: float = 0.2) -> int:
    """Start every node's command, stream their output as `HOST: line`, and wait for all of them.

    SIGINT / SIGTERM are forwarded to every command (each runs in its own session, so a terminal's Ctrl-C
    reaches this launcher only): node 0's `memtrain run` passes it to its workers, which stop every node at
    the same step; a remote shell ends its connection. A node that fails (say node 0 refusing the run
    directory before it hosts the rendezvous) gets the others SIGTERM rather than leaving them to wait out
    the join timeout. Returns the worst exit code: the highest of the nodes that ended by themselves (a
    command killed by a signal counting as 128 + the signal), at least 128 + the signal forwarded.
    """
    out = out or sys.stdout
    lock = threading.Lock()
    width = max(len(node.host) for node in nodes)
    processes: list[subprocess.Popen] = []
    received: list[int] = []
    stopped: set[int] = set()  # the nodes this launcher ended because another failed: their codes do not count

    def forward(signum, frame):
        received.append(signum)
        for process in processes:
            if process.poll() is None:
                process.send_signal(signum)

    def pump(host: str, stream: IO[str]) -> None:
        for line in stream:
            with lock:
                out.write(f"{host.rjust(width)}: {line if line.endswith(chr(10)) else line + chr(10)}")
                out.flush()

    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    pumps = []
    try:
        for node in nodes:
            if received:
                break
            processes.append(
                subprocess.Popen(
                    node.argv,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    text=True,
                    errors="replace",
                    start_new_session=True,
                    env=dict(os.environ, PYTHONUNBUFFERED="1"),
                )
            )
            pumps.append(threading.Thread(target=pump, args=(node.host, processes[-1].stdout), daemon=True))
            pumps[-1].start()
        while any(process.poll() is None for process in processes):
            failed = any(process.returncode for i, process in enumerate(processes) if i not in stopped)
            if failed and not received:
                for i, process in enumerate(processes):
                    if process.poll() is None and i not in stopped:
                        stopped.add(i)
                        process.terminate()
            time.sleep(poll_s)
        for thread in pumps:
            thread.join(timeout=10)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    codes = [
        exit_code(-p.returncode) if p.returncode < 0 else p.returncode
        for i, p in enumerate(processes)
        if i not in stopped
    ]
    worst = max(codes, default=0)
    return max(worst, exit_code(received[0])) if received else worst
