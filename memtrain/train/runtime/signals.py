"""Signals reach every process, and every process ends with its launcher.

- Exit codes are the shell's: 128 + the signal (130 for Ctrl-C / SIGINT, 143 for SIGTERM).
- During start-up (before the loop installs its own handlers, which finish the step and save) SIGINT
  and SIGTERM raise `Stopped`, so `memtrain run` ends with one line and the conventional code.
- With several processes the launcher starts torchrun in its own process group (a terminal's Ctrl-C
  reaches the launcher alone, not every process twice) and forwards SIGINT/SIGTERM to it; torchrun
  forwards them to the workers, which save and exit, and waits for them (TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
  long enough for a save). The launcher then exits 128 + the signal.
- torchrun's own failures become exit codes, not tracebacks: workers that failed pass on the first one's
  code (2 for a UserError, whose lines the worker printed; 75 to restart after an OOM), and a rendezvous
  that gives up (a master that cannot be reached, nodes that did not all join within the timeout) is one
  line and exit 2.
- Processes reach the signal in different phases: one may still be starting (and leave at once) while another
  is in the loop's step, whose collectives then break. A worker whose collective broke after a stop signal
  reached it stops as the first did, with the same line and code, not a traceback (`received_stop`).
- A process killed without a word (SIGKILL, the out-of-memory killer): the torchrun agent of its node names its rank
  and node and ends with EXIT_PEER_LOST (69); its local peers, which the agent stops with SIGTERM, end quietly, as
  they tell that SIGTERM from one their launcher forwarded (`stop_asked`). Survivors on other nodes say it
  themselves (memtrain.train.runtime.peers). torchrun's own C++ log lines (a store that cannot be reached, with a C++
  stack for each try) are silenced in the torchrun process: memtrain's line says what they say.
- No worker outlives its launcher: torchrun runs with a parent-death signal of SIGTERM (the launcher
  killed with SIGKILL: torchrun shuts the workers down as above), and each worker with SIGKILL (torchrun
  itself gone: nothing is left to coordinate the ranks; the last complete checkpoint stands).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from memtrain.errors import UserError
from memtrain.train.runtime.peers import killed_line
from memtrain.train.runtime.result import EXIT_PEER_LOST, EXIT_RESTART

PR_SET_PDEATHSIG = 1
LAUNCHER_PID_ENV = "MEMTRAIN_LAUNCHER_PID"
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
SHUTDOWN_TIMEOUT_S = 900  # torchrun's default 30 s kills a worker still writing a 7B checkpoint
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received_stops: list[int] = []  # every SIGINT / SIGTERM a stop handler of this process took, in order


def exit_code(signum: int) -> int:
    return 128 + int(signum)


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM outside the training loop (a KeyboardInterrupt, so `except Exception` lets it pass)."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


def signum_of(interrupt: KeyboardInterrupt) -> int:
    return interrupt.signum if isinstance(interrupt, Stopped) else int(signal.SIGINT)


def signal_name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def note_stop(signum: int) -> None:
    """A stop handler took `signum` (start-up's or the loop's): remembered for `received_stop`."""
    _received_stops.append(int(signum))


def received_stop() -> int | None:
    """The first SIGINT / SIGTERM this process was asked to stop by, if any."""
    return _received_stops[0] if _received_stops else None


def not_saved_line(signum: int) -> str:
    """What a run stopped before it could save says (start-up, or a second Ctrl-C while saving)."""
    return (
        f"stopped by {signal_name(signum)} before the run could save; the run directory keeps its last "
        "complete checkpoint, if any — run the same command to resume"
    )


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise Stopped in the main thread while the block runs (the loop's own handlers,
    installed inside it, take over while training)."""

    def stop(signum, frame):
        note_stop(signum)
        raise Stopped(signum)  # lost when it lands in a finaliser ("Exception ignored in ..."): the loop then
        # finds the stop noted (received_stop) and stops at its first step

    _received_stops.clear()  # a new command: the stops of one before it in this process are not its own
    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def die_with_parent(signum: int, parent_pid: int | None = None) -> None:
    """Ask Linux to send `signum` to this process when its parent exits (prctl PR_SET_PDEATHSIG); exit at
    once if the parent (`parent_pid`, when given) is already gone. No-op where prctl is missing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), signum)


def python_command(module: str) -> list[str]:
    """`python -m MODULE` whose start a Ctrl-C cannot turn into a traceback: runpy imports the module's packages
    and the module itself before any handler of memtrain's is set, and a SIGINT the launcher forwards right then
    (torchrun just started, or a worker) ended in a KeyboardInterrupt traceback from <frozen runpy>. Here it ends
    with 130; the launcher says the line (`unsaid_stop_line`)."""
    code = (
        f"import runpy, sys\ntry:\n    runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
        f"except KeyboardInterrupt:\n    sys.exit({exit_code(signal.SIGINT)})\n"
    )
    return [sys.executable, "-u", "-c", code]


def unsaid_stop_line(said_dir: Path, code: int) -> str | None:
    """The line for a run its launcher stopped (exit 130 / 143) when no worker said anything: they were stopped
    before their handlers were set, or before they started. None when one of them spoke or the run was not
    stopped."""
    if code not in (exit_code(sig) for sig in STOP_SIGNALS):
        return None
    try:
        if any(said_dir.iterdir()):
            return None
    except OSError:
        pass
    return f"■ {not_saved_line(code - 128)}"


def run_forwarding_signals(command: list[str], env: dict[str, str]) -> int:
    """Run `command` (torchrun) in its own process group, forwarding SIGINT/SIGTERM to it, and wait.

    Returns its exit code, or 128 + the first signal forwarded when it did not succeed (a run that finished
    anyway, its final model written, is a success, not 130).
    """
    env = dict(env, **{LAUNCHER_PID_ENV: str(os.getpid())})
    env.setdefault(SHUTDOWN_TIMEOUT_ENV, str(SHUTDOWN_TIMEOUT_S))
    received: list[int] = []
    process = subprocess.Popen(command, env=env, start_new_session=True)

    def forward(signum, frame):
        received.append(signum)
        note_stop_asked(env.get(SAID_DIR_ENV), signum)
        if process.poll() is None:
            process.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    try:
        code = process.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return exit_code(received[0]) if received and code != 0 else code


EXIT_BARRIER_LOGGER = "torch.distributed.elastic.agent.server.api"
EXIT_BARRIER_ERROR = "Error waiting on exit barrier"
WORKERS_LOGGER = "torch.distributed.elastic.multiprocessing.api"
SAID_DIR_ENV = "MEMTRAIN_SAID_DIR"  # where the workers of one node mark the problem lines one of them printed
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")  # left out of the problem lines' marker (say_once)
ENDING_MARK = "ending"  # in SAID_DIR_ENV: the code a worker that ends on purpose ends with (mark_ending)
STOP_ASKED_MARK = "stop-asked"  # in SAID_DIR_ENV: the signal the launcher forwarded (a person's or a scheduler's stop)
CPP_LOG_LEVEL_ENV = "TORCH_CPP_LOG_LEVEL"


class QuietExitBarrier(logging.Filter):
    """torchrun's agents meet once more after their workers have ended (the exit barrier), on the store that
    node 0's agent hosts. An agent still waiting there when node 0's has left finds the store closed and logs
    it as an error with a traceback (seen on two CPU "nodes" of one machine under load), although every worker
    had finished and the run's result and exit code stand (worker.leave_after_node_0 makes it rare, not
    impossible). The record becomes one warning line that says so."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith(EXIT_BARRIER_ERROR):
            record.msg, record.args = (
                ("the nodes' exit barrier broke (node 0 left first); every worker had finished, so nothing is lost"),
                (),
            )
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


class QuietWorkerEnds(logging.Filter):
    """torchrun's lines about its workers' ends that say nothing more to a person than memtrain's own line does: a
    worker that ended with a UserError (exit 2) printed its problem, one that asks every process to start again
    (exit 75, memtrain.train.runtime.result.EXIT_RESTART) said why; on Ctrl-C or SIGTERM, "■ interrupted at step N"
    follows its "Received 2 death signal, shutting down workers" and "Sending process N closing signal SIGINT"."""

    def filter(self, record: logging.LogRecord) -> bool:
        said = record.getMessage()
        return not (
            said.startswith(
                tuple(f"failed (exitcode: {code})" for code in (UserError.exit_code, EXIT_RESTART, EXIT_PEER_LOST))
            )
            or killed_worker(said)
            or (said.startswith("Received") and "death signal" in said)
            or (said.startswith("Sending process") and "closing signal" in said)
        )


def mark_ending(code: int) -> None:
    """Tell this attempt's other workers on this node that this one is ending on purpose, with `code` (EXIT_RESTART
    for a restart, 2 for a problem it has said): their collective breaks, or torchrun stops them, because of it, and
    they end quietly with the same code instead of a gloo traceback."""
    said_dir = os.environ.get(SAID_DIR_ENV)
    if said_dir:
        try:
            Path(said_dir, ENDING_MARK).write_text(str(code))
        except OSError:
            pass  # they then say that a peer left; the run ends all the same


def killed_worker(said: str) -> bool:
    """Whether torchrun's line says a worker ended by a signal that is not a stop (memtrain's own line names it)."""
    if not said.startswith("failed (exitcode: -"):
        return False
    try:
        signum = -int(said.removeprefix("failed (exitcode: ").split(")", 1)[0])
    except ValueError:
        return False
    return signum not in STOP_SIGNALS


def note_stop_asked(said_dir: str | None, signum: int) -> None:
    """The launcher forwards a stop: its workers then know that a SIGINT / SIGTERM is a person's (or a scheduler's),
    not torchrun's agent stopping them because another worker of the node died."""
    if said_dir:
        try:
            Path(said_dir, STOP_ASKED_MARK).write_text(str(int(signum)))
        except OSError:
            pass  # the workers then take the stop for a lost peer only if a collective broke after it


def stop_asked() -> bool:
    """Whether this attempt's launcher forwarded a stop (note_stop_asked); True where there is no launcher."""
    said_dir = os.environ.get(SAID_DIR_ENV)
    return not said_dir or Path(said_dir, STOP_ASKED_MARK).exists()


def marked_ending() -> int | None:
    """The code another worker of this attempt on this node ends with on purpose (mark_ending), else None."""
    said_dir = os.environ.get(SAID_DIR_ENV)
    if not said_dir:
        return None
    try:
        return int(Path(said_dir, ENDING_MARK).read_text())
    except (OSError, ValueError):
        return None


def say_once(lines: list[str]) -> bool:
    """Whether this worker should print `lines` (a UserError's problems): the first worker of a node to claim them
    (a marker file in the launcher's SAID_DIR_ENV directory) does, the others, meeting the same problem (a full
    disk, a recipe the data refuses), do not. Lines that differ only in their numbers are the same problem: each
    rank measures the free space of the full disk a moment apart (77 GB free, 78 GB free). Other lines are all
    printed. True without the directory."""
    said_dir = os.environ.get(SAID_DIR_ENV)
    if not said_dir:
        return True
    shape = NUMBER.sub("#", "\n".join(lines))
    marker = Path(said_dir) / hashlib.sha256(shape.encode()).hexdigest()
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:
        return True  # cannot mark: printed twice rather than not at all
    return True


def torchrun_main(argv: list[str]) -> int:
    """`python -m memtrain.train.runtime.signals ARGS`: torchrun that dies with its launcher, without a traceback when
    it is told to stop (it shuts its workers down first) or when its exit barrier breaks after a finished run."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    die_with_parent(signal.SIGTERM, int(launcher) if launcher else None)
    quiet_cpp_logs()
    logging.getLogger(EXIT_BARRIER_LOGGER).addFilter(QuietExitBarrier())
    for logger in (EXIT_BARRIER_LOGGER, WORKERS_LOGGER):  # the agent's and its workers' loggers
        logging.getLogger(logger).addFilter(QuietWorkerEnds())
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except SignalException as stop:
        return exit_code(stop.sigval)
    except ChildFailedError as failed:  # the workers said why; their code says what the launcher does next
        killed = sorted(
            ((failure.timestamp, rank, failure) for rank, failure in failed.failures.items() if failure.exitcode < 0),
            key=lambda item: item[0],
        )
        killed = [(rank, failure) for _, rank, failure in killed if -failure.exitcode not in STOP_SIGNALS]
        if killed:  # a worker died without a word: only this agent saw how
            rank, failure = killed[0]
            print(f"✗ {killed_line(rank, _nproc_of(argv), -failure.exitcode, failure.pid)}", file=sys.stderr)
            return EXIT_PEER_LOST
        code = failed.get_first_failure()[1].exitcode
        return exit_code(-code) if code < 0 else code
    except (DistError, RendezvousError) as error:  # joining the other nodes gave up after the stated timeout
        print(
            f"✗ the nodes did not all join ({_rendezvous_of(argv)}): {error} — start `memtrain run` on every node "
            "with the same recipe, --nnodes, --master-addr and --master-port (each within the timeout of the "
            "first); check that the master's address resolves and its port is open from the other nodes; "
            "a node that stopped before joining printed why",
            file=sys.stderr,
        )
        return 2
    return 0


def quiet_cpp_logs() -> None:
    """Silence c10's C++ log lines in this process only (torchrun's): a store it cannot reach logs each try with a
    C++ stack of ~30 frames before memtrain's one line says the same. c10 reads the level once, when torch is
    imported; the workers, started with this process's environment, keep the level they were given."""
    before = os.environ.get(CPP_LOG_LEVEL_ENV)
    os.environ[CPP_LOG_LEVEL_ENV] = "FATAL"
    import torch  # noqa: F401, PLC0415 — imported here, so that c10 reads the level above

    if before is None:
        os.environ.pop(CPP_LOG_LEVEL_ENV)
    else:
        os.environ[CPP_LOG_LEVEL_ENV] = before


def _nproc_of(argv: list[str]) -> int:
    """--nproc_per_node from torchrun's arguments (the node of a rank: memtrain.train.runtime.peers.node_of)."""
    flags = dict(arg.lstrip("-").split("=", 1) for arg in argv if arg.startswith("--") and "=" in arg)
    value = flags.get("nproc_per_node", "1")
    return int(value) if value.isdigit() else 1


def _rendezvous_of(argv: list[str]) -> str:
    """'node R of N at HOST:PORT, timeout T s' from torchrun's arguments, for the message above."""
    flags = dict(arg.lstrip("-").split("=", 1) for arg in argv if arg.startswith("--") and "=" in arg)
    timeout = next((arg.split("=", 1)[1] for arg in argv if arg.startswith("timeout=")), "?")
    return (
        f"node {flags.get('node_rank', '?')} of {flags.get('nnodes', '?')} at {flags.get('master_addr', '?')}:"
        f"{flags.get('master_port', '?')}, timeout {timeout} s"
    )


if __name__ == "__main__":
    sys.exit(torchrun_main(sys.argv[1:]))
