"""scripts/bench_attention.py on the CPU: one CSV row per kernel, the same packed tokens timed under each."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_attention_writes_a_row_per_kernel_over_the_same_tokens(tmp_path):
    out = tmp_path / "attention.csv"
    command = [sys.executable, "scripts/bench_attention.py", "--preset", "tiny", "--layers", "1"]
    command += ["--micro-batch", "2", "--seq-len", "256", "--steps", "1", "--warmup", "0", "--out", str(out)]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True, timeout=300)
    rows = list(csv.DictReader(out.open()))
    assert [row["kernel"] for row in rows] == ["sdpa-mask", "varlen", "sdpa-plain"]
    assert len({(row["samples"], row["padding_share"]) for row in rows}) == 1  # the same micro-batch for each
    assert int(rows[0]["samples"]) >= 2 and 0 <= float(rows[0]["padding_share"]) < 0.5
    for row in rows:
        assert float(row["step_s"]) > 0 and int(row["tokens_per_s"]) > 0
        assert row["machine"] == "cpu" and row["command"].startswith("python scripts/bench_attention.py")
