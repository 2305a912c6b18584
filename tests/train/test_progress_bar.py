"""The training bar keeps the step, its total and the ETA on a narrow console; the stats give way, cut with '…'."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from memtrain.train.progress_bar import Progress

RECORD = {
    "loss": 8.245,
    "tokens_per_s": 12345.0,
    "tokens": 9000,  # real tokens of the 10,000 positions computed so far: 10 % padding
    "padded_tokens": 10000,
    "gpu_peak_reserved_bytes": 20.1 * 2**30,
    "gpu_cap_bytes": 24 * 2**30,
    "micro_batch": 8,
}


def last_line(width: int, steps: int) -> str:
    screen = io.StringIO()
    with Progress(steps, console=Console(file=screen, width=width, force_terminal=True)) as bar:
        bar.update(2, RECORD)
        bar.note_eval(2, 8.09)
    lines = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", screen.getvalue()).strip().splitlines()
    return lines[-1]


@pytest.mark.parametrize("width", [60, 80, 100])
def test_a_narrow_console_keeps_the_step_its_total_and_the_eta(width):
    line = last_line(width, 61234)  # one epoch of a large dataset ("2/61…" at 80 columns)
    assert "2/61234" in line and "eta" in line and len(line) <= width
    assert line.index("loss 8.") > line.index("2/61234") and "…" in line  # the stats gave way


def test_a_wide_console_shows_every_stat_and_the_validation_perplexity():
    line = last_line(160, 300)
    assert "loss 8.245 · 12,345 tok/s · pad 10% · gpu 20.1/24 GiB · mb 8 · val ppl 3261.7" in line and "…" not in line
