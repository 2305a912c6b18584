"""The launcher hands its options to torchrun's workers as flags: one owner writes and reads them."""

from __future__ import annotations

import pytest

from memtrain.train.resolve import RunOptions
from memtrain.train.worker import parse_options


@pytest.mark.parametrize("options", [RunOptions(), RunOptions(resume=False, max_steps=3, profile_steps=2, save=False)])
def test_worker_flags_round_trip(options):
    run_file, parsed = parse_options(["runs/x/run.json", *options.to_flags()])
    assert parsed == options and str(run_file) == "runs/x/run.json"
