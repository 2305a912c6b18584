"""train.cuda_graphs on a CUDA GPU: a run whose compiled layers replay CUDA graphs trains as the same run without them,
step by step and at its evaluations, with DeepSpeed really running and the graphs really replayed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import read_records, train_losses

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")

# The run in a process of its own, on DeepSpeed's CUDA accelerator (the test session's is the CPU's), counting the
# graph trees' recordings and replays of recorded graphs as it goes.
COUNTING_RUN = """
import json, sys
from torch._inductor import cudagraph_trees
calls = {"record_function": 0, "execute_node": 0}
for name in calls:
    original = getattr(cudagraph_trees.CUDAGraphTreeManager, name)
    def counted(self, *args, _original=original, _name=name, **kwargs):
        calls[_name] += 1
        return _original(self, *args, **kwargs)
    setattr(cudagraph_trees.CUDAGraphTreeManager, name, counted)
from memtrain.commands.run import run_command
code = run_command(sys.argv[1], [])
print("graph calls", json.dumps(calls))
sys.exit(code)
"""


def _run(recipe: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    done = subprocess.run(
        [sys.executable, "-c", COUNTING_RUN, str(recipe)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.rsplit("graph calls", 1)[1].splitlines()[0])


def test_replayed_layers_train_as_launched_ones(write_recipe):
    base = {
        "model": {"lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
        "batch": {"global_batch": 8, "micro_batch": 2},  # four micro-batches accumulated a step
        "train": {"steps": 6, "eval_every": 3, "save_every": 100, "compile": True},
    }
    runs = {
        graphs: write_recipe(f"graphs-{graphs}", {**base, "train": {**base["train"], "cuda_graphs": graphs}})
        for graphs in (False, True)
    }
    assert _run(runs[False]) == {"record_function": 0, "execute_node": 0}
    calls = _run(runs[True])
    assert calls["record_function"] > 0 and calls["execute_node"] > calls["record_function"], calls
    run_a, run_b = (Path(yaml.safe_load(p.read_text())["train"]["output_dir"]) for p in (runs[False], runs[True]))
    a, b = train_losses(run_a), train_losses(run_b)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4, abs=1e-5), step
    assert a[6] < a[1]  # it trained
    evals = [[r["loss"] for r in read_records(run, "eval")] for run in (run_a, run_b)]
    assert len(evals[0]) == 2 and evals[1] == pytest.approx(evals[0], rel=1e-4)
