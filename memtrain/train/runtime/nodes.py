"""Runs that span several machines: which node this is, where the rendezvous is, and what every node
must agree on before a step.

memtrain drives torchrun the torchrun way: one `memtrain run` per node, the same recipe and the same
`--master-addr` / `--master-port` everywhere, `--node-rank` 0..N-1. torchrun's static rendezvous joins
the nodes (node 0 hosts it); memtrain reimplements none of it. What memtrain adds:
- `rendezvous_for`: the node count, this node's rank and the master from the flags, else from what
  torchrun's and Slurm's environments already say (MASTER_ADDR, MASTER_PORT, NODE_RANK, SLURM_NNODES,
  SLURM_NODEID, the first host of SLURM_JOB_NODELIST), refused with what to pass when something is missing.
- A stated join timeout: torchrun's rendezvous gives up after it (a master that cannot be reached, a node
  that never came), and `memtrain.train.runtime.signals` turns that into one line and exit 2.
- `agree_on_run`, in every worker once the process group is up: the ranks compare the recipe and the
  resolved run (and the run's options); any difference stops every node with exit 2, naming the keys.
  Then rank 0 writes a token into the run directory and one process per node must see it: checkpoints
  are written by every rank into one directory, so it must be storage that every node mounts.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from memtrain.errors import Problem, UserError
from memtrain.train.resolve import ResolvedRun, RunOptions
from memtrain.train.runtime.distributed import Place, barrier

DEFAULT_MASTER_PORT = 29500  # torchrun's own default, so a launcher and a memtrain node can meet there
JOIN_TIMEOUT_S = 300  # how long node 0 waits for the others, and the others for node 0
SHARED_DIR_WAIT_S = 10.0  # network file systems may show a new file a few seconds late (attribute caches)
SHARED_TOKEN_PREFIX = ".memtrain-shared-"


@dataclass(frozen=True)
class NodeFlags:
    """What `memtrain run`'s command line says about the nodes (None: not given; the environment may say)."""

    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    join_timeout_s: int = JOIN_TIMEOUT_S
    hostfile: Path | None = None  # one command on the first node starts every node (memtrain.train.runtime.hostfile)
    remote_shell: str = "ssh"  # how it reaches the other hosts: `REMOTE_SHELL HOST COMMAND`


@dataclass(frozen=True)
class Rendezvous:
    """Where this node's torchrun meets the others."""

    nodes: int
    node_rank: int
    master_addr: str
    master_port: int
    join_timeout_s: int = JOIN_TIMEOUT_S

    @classmethod
    def alone(cls) -> Rendezvous:
        """One node: its processes meet on this host (the port is picked free for each torchrun)."""
        return cls(1, 0, "127.0.0.1", 0)

    @property
    def is_first(self) -> bool:
        """Node 0 owns the run directory: it claims it, and its torchrun hosts the rendezvous."""
        return self.node_rank == 0

    def torchrun_flags(self) -> list[str]:
        return [
            f"--nnodes={self.nodes}",
            f"--node_rank={self.node_rank}",
            f"--master_addr={self.master_addr}",
            f"--master_port={self.master_port}",
            "--rdzv_conf",
            f"timeout={self.join_timeout_s}",
        ]

    def describe(self) -> str:
        return f"node {self.node_rank} of {self.nodes}, rendezvous at {self.master_addr}:{self.master_port}"


def node_count(flags: NodeFlags, env: Mapping[str, str]) -> int | None:
    """--nnodes, else the nodes of a Slurm allocation; None when neither says (the recipe's hardware.nodes)."""
    if flags.nnodes is not None:
        return flags.nnodes
    for name in ("SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        if env.get(name, "").isdigit():
            return int(env[name])
    return None


def rendezvous_for(nodes: int, flags: NodeFlags, env: Mapping[str, str]) -> Rendezvous:
    """This node's rendezvous for a run of `nodes` machines: flags first, then the environment.

    One node needs nothing: its processes meet on a free local port. Raises UserError naming the flag
    to pass when several nodes are asked for and this node's rank or the master is unknown.
    """
    if nodes == 1:
        return replace(Rendezvous.alone(), join_timeout_s=flags.join_timeout_s)
    problems = []
    rank = flags.node_rank if flags.node_rank is not None else _int_from(env, "NODE_RANK", "SLURM_NODEID")
    if rank is None:
        problems.append(
            Problem(
                f"the run spans {nodes} nodes but nothing says which one this is",
                key="hardware.nodes",
                hint="pass --node-rank R (0 on the master node, then 1, 2, ...), "
                "or start memtrain with srun, which sets SLURM_NODEID",
            )
        )
    elif not 0 <= rank < nodes:
        problems.append(
            Problem(
                f"node rank {rank} is outside 0..{nodes - 1}",
                key="hardware.nodes",
                hint=f"pass --node-rank between 0 and {nodes - 1}, or --nnodes {rank + 1} or more",
            )
        )
    addr = flags.master_addr or env.get("MASTER_ADDR") or _first_slurm_host(env)
    if not addr:
        problems.append(
            Problem(
                f"the run spans {nodes} nodes but no master address is given",
                hint="pass --master-addr HOST (node 0's hostname or IP, the same on every node), or set MASTER_ADDR",
            )
        )
    port = flags.master_port or _int_from(env, "MASTER_PORT") or DEFAULT_MASTER_PORT
    if problems:
        raise UserError(problems)
    return Rendezvous(nodes, rank, addr, port, flags.join_timeout_s)


def _int_from(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        if env.get(name, "").strip().isdigit():
            return int(env[name])
    return None


def _first_slurm_host(env: Mapping[str, str]) -> str | None:
    """The first hostname of the Slurm allocation (`scontrol show hostnames`), where Slurm is installed."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    scontrol = shutil.which("scontrol")
    if not nodelist or scontrol is None:
        return None
    try:
        out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    hosts = out.stdout.split()
    return hosts[0] if out.returncode == 0 and hosts else None


def run_digest(run: ResolvedRun) -> str:
    """A short hash of the resolved run (the recipe with it), printed at start-up so nodes can be compared."""
    return hashlib.sha256(run.to_json().encode()).hexdigest()[:12]


def agree_on_run(run: ResolvedRun, options: RunOptions, place: Place) -> None:
    """Every rank of every node compares what it is about to run with rank 0's; then, on several nodes, checks
    that the run directory is shared. Collective: every rank calls it, and every rank raises the same UserError."""
    if place.world_size == 1:
        return
    import torch.distributed as dist

    mine = {"node": place.node_rank, "run": json.loads(run.to_json()), "flags": options.to_flags()}
    everyone: list[dict] = [{}] * place.world_size
    dist.all_gather_object(everyone, mine)
    first = everyone[0]
    problems, seen = [], set()
    for other in everyone[1:]:
        differences = _differences(first, other)
        if differences and other["node"] not in seen:
            seen.add(other["node"])
            problems.append(
                Problem(
                    f"node {other['node']} would run something else than node 0: {'; '.join(differences[:6])}"
                    + (f" (and {len(differences) - 6} more)" if len(differences) > 6 else ""),
                    hint="start every node with the same recipe file, overrides and flags (and the same memtrain, "
                    "PyTorch and data), then run the command again",
                )
            )
    if problems:
        raise UserError(problems)
    if len({member["node"] for member in everyone}) > 1:
        _check_shared_run_dir(run.run_dir, place)


def _differences(first: dict, other: dict) -> list[str]:
    """'key: A on node 0, B on node N' for every leaf that differs (recipe keys without their prefix)."""
    mine, theirs = (
        _leaves({"run": first["run"], "flags": first["flags"]}),
        _leaves({"run": other["run"], "flags": other["flags"]}),
    )
    out = []
    for key in sorted(set(mine) | set(theirs)):
        if mine.get(key) != theirs.get(key):
            name = key.removeprefix("run.recipe.").removeprefix("run.")
            out.append(f"{name} is {mine.get(key)!r} on node 0, {theirs.get(key)!r} on node {other['node']}")
    return out


def _leaves(data: object, prefix: str = "") -> dict[str, object]:
    if isinstance(data, dict):
        out: dict[str, object] = {}
        for key, value in data.items():
            out.update(_leaves(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): data}


def _check_shared_run_dir(run_dir: Path, place: Place) -> None:
    """Rank 0 writes a token into the run directory; the first process of every node must see it."""
    import torch.distributed as dist

    token = [f"{SHARED_TOKEN_PREFIX}{uuid.uuid4().hex}" if place.is_main else ""]
    path = None
    if place.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / token[0]
        path.write_text(token[0])
    dist.broadcast_object_list(token, src=0)
    seen = True
    if place.local_rank == 0 and not place.is_main:
        deadline = time.monotonic() + SHARED_DIR_WAIT_S
        while not (seen := (run_dir / token[0]).is_file()) and time.monotonic() < deadline:
            time.sleep(0.5)
    answers: list[tuple[int, bool]] = [(0, True)] * place.world_size
    dist.all_gather_object(answers, (place.node_rank, seen))
    barrier()
    if path is not None:
        path.unlink(missing_ok=True)
    blind = sorted({node for node, saw in answers if not saw})
    if blind:
        which = ", ".join(map(str, blind))
        raise UserError(
            Problem(
                f"node{'s' if len(blind) > 1 else ''} {which} cannot see the run directory {run_dir} that rank 0 "
                f"writes (a file rank 0 wrote there did not appear within {SHARED_DIR_WAIT_S:.0f} s); every rank "
                "writes its part of each checkpoint into that one directory, so it must be on storage that every node "
                "mounts at the same path",
                key="train.output_dir",
                hint="set train.output_dir to a shared file system (NFS, Lustre, ...) mounted at the same path on "
                "every node, with absolute paths",
            )
        )
