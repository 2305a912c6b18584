"""The `memtrain` entry point: --version, and a Ctrl-C while Python imports the command line (seconds) or while a
command works."""

from __future__ import annotations

import subprocess
import sys

# A script's first lines: a real SIGINT to itself as soon as torch starts to import (the seconds a Ctrl-C may cut)
INTERRUPT_ONCE_TORCH_LOADS = """
import os, runpy, signal, sys, threading, time

def interrupt_once_torch_loads():
    while "torch" not in sys.modules:
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGINT)

threading.Thread(target=interrupt_once_torch_loads, daemon=True).start()
"""
INTERRUPT_DURING_IMPORT = (
    INTERRUPT_ONCE_TORCH_LOADS
    + """
sys.argv = ["memtrain", "--help"]
from memtrain.__main__ import main
main()
"""
)


def test_ctrl_c_while_the_command_line_imports_ends_with_one_line_and_130():
    done = subprocess.run([sys.executable, "-c", INTERRUPT_DURING_IMPORT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 130, done.stderr[-3000:]
    assert done.stderr.strip() == "■ stopped by Ctrl-C while starting", done.stderr[-3000:]
    assert done.stdout == ""  # --help was never reached


INTERRUPT_DURING_PLAN = """
import os, signal, sys, time
import memtrain.cli

def plan_until_interrupted(*args, **kwargs):  # a real SIGINT while the command works (planning takes seconds)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(60)

memtrain.cli.plan_command = plan_until_interrupted
sys.argv = ["memtrain", "plan", "recipes/quickstart.yaml"]
from memtrain.__main__ import main
main()
"""


def test_ctrl_c_while_a_command_works_ends_with_one_line_and_130():
    done = subprocess.run([sys.executable, "-c", INTERRUPT_DURING_PLAN], capture_output=True, text=True, timeout=300)
    assert done.returncode == 130, done.stderr[-3000:]
    assert done.stderr.strip() == "■ stopped by Ctrl-C", done.stderr[-3000:]
    assert "Aborted" not in done.stderr and done.stdout == ""


def test_the_entry_point_runs_the_command_line():
    done = subprocess.run([sys.executable, "-m", "memtrain", "--help"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "plan" in done.stdout and "run" in done.stdout, done.stderr[-3000:]


def test_version_names_memtrain_and_the_stack_a_bug_report_needs():
    from importlib.metadata import version

    import torch
    from typer.testing import CliRunner

    from memtrain import __version__
    from memtrain.cli import app

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"memtrain {__version__} (torch {version('torch')}, deepspeed ")
    assert version("memtrain") == __version__  # pyproject reads the version from the package: one owner
    assert torch.__version__.split("+")[0] in result.output


def test_the_command_line_does_not_import_matplotlib_which_only_report_needs():
    """matplotlib took 1.2 s of `import memtrain.cli` (python -X importtime, two cores): every run, plan and
    validate paid it. Only `memtrain report` draws."""
    check = "import sys, memtrain.cli; print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))"
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout[-2000:] + done.stderr[-2000:]


def test_bitsandbytes_asking_the_hub_for_a_cpu_kernel_prints_nothing():
    """PEFT imports bitsandbytes, which on AVX512-BF16 CPUs asks the hub for a 4-bit kernel and logs a warning
    when it cannot have one, in every run and plan (seen on this project's machines; a CPU without AVX512-BF16
    never asks, and this test then checks nothing more than the import)."""
    done = subprocess.run([sys.executable, "-c", "import memtrain, peft"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "kernels-community" not in done.stderr, done.stderr[-2000:]


INTERRUPT_DURING_TEARDOWN = """
import atexit, os, signal, sys, time

def interrupted_at_exit():  # a Ctrl-C that lands in an atexit callback, after the command said how it ended
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)

atexit.register(interrupted_at_exit)
sys.argv = ["memtrain", "validate", "recipes/quickstart.yaml"]
from memtrain.__main__ import main
main()
"""


def test_ctrl_c_after_the_command_said_how_it_ended_prints_no_atexit_traceback():
    done = subprocess.run(
        [sys.executable, "-c", INTERRUPT_DURING_TEARDOWN], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]  # the command's own code
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr, done.stderr[-3000:]
    assert "is a valid recipe" in done.stdout
