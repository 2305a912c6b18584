"""What the benchmark scripts share: the project root, the machine's name, a run directory per case, and the
committed tables (a CSV keyed by some columns, each row with its command, machine and date, and its Markdown view)."""

from __future__ import annotations

import csv
import os
import platform
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What a side that did not finish leaves: no metrics (out of memory before the first step, a timeout), too few steps
# to time, or a half-written result file (json's decode error is a ValueError). Its row says so instead of stopping
# the others.
RUN_FAILURES = (
    subprocess.TimeoutExpired,
    FileNotFoundError,
    StopIteration,
    ValueError,
    ZeroDivisionError,
    KeyError,
    IndexError,
    TypeError,
)
GiB = 1024**3


def machine_name() -> str:
    """The GPU's name where there is one, else the CPU's."""
    try:
        import torch  # here, not at the top: the table scripts that never touch a GPU start without loading torch
    except ImportError:
        return f"{cpu_name()} CPU"
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"{cpu_name()} CPU"


def cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what platform knows of it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_dir_for(runs: Path, name: str) -> Path:
    """A directory for a case whose label may hold spaces, colons or commas (an override would misread them)."""
    return runs / re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")


def run_logged(command: list[str], stream, timeout_s: int) -> int | None:
    """Run a measuring command from the project root, its output into `stream`, without the rank variables of a
    launcher that started this script (they would make the run join that launcher's group); its exit code, or None
    when it ran past `timeout_s`."""
    from memtrain.train.runtime.distributed import without_rank_variables  # imports torch: only when a run starts

    try:
        done = subprocess.run(
            command,
            cwd=ROOT,
            stdout=stream,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            env=without_rank_variables(os.environ),
        )
    except subprocess.TimeoutExpired:
        return None
    return done.returncode


def run_status(code: int | None) -> str:
    """A table's status word for `run_logged`'s result: ok, rc N, or timeout."""
    return "timeout" if code is None else "ok" if code == 0 else f"rc {code}"


def write_markdown(rows: list[dict], path: Path, title: str, columns: list[str]) -> None:
    lines = [f"# {title}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(c, "")).replace("|", "\\|") for c in columns) + " |")
    path.write_text("\n".join(lines) + "\n")


def upsert_row(
    out: Path,
    row: dict,
    columns: list[str],
    title: str,
    keys: tuple[str, ...] = ("recipe",),
    defaults: dict | None = None,
) -> None:
    """Replace the row with the same `keys` in the CSV (or add it) and rewrite its Markdown view.

    defaults: values for columns that rows written before the column existed lack."""
    rows = list(csv.DictReader(out.open())) if out.exists() else []
    rows = [{**(defaults or {}), **{k: v for k, v in r.items() if k is not None and v is not None}} for r in rows]
    rows = [r for r in rows if any(r.get(k) != row.get(k) for k in keys)] + [row]
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    write_markdown(rows, out.with_suffix(".md"), title, columns)
