"""MetricsLog: buffered tensors, one host transfer per flush, a file that survives being killed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from memtrain.monitor import metrics as metrics_module
from memtrain.monitor.metrics import MetricsLog, read_metrics, read_metrics_counted
from memtrain.monitor.tensorboard import tensorboard_available

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def counted_stacks(monkeypatch):
    """Counts torch.stack calls made by the metrics module and forbids per-value `.item()` syncs."""
    calls = []
    real_stack = torch.stack

    def stack(tensors, *args, **kwargs):
        calls.append(len(tensors))
        return real_stack(tensors, *args, **kwargs)

    def item(self):
        raise AssertionError("MetricsLog read a tensor with .item(): one host sync per value")

    monkeypatch.setattr(metrics_module.torch, "stack", stack)
    monkeypatch.setattr(torch.Tensor, "item", item)
    return calls


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_records_stay_tensors_until_one_stack_converts_them_all(tmp_path, counted_stacks):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, flush_every=4)
    losses = [torch.tensor(2.5 - 0.25 * i) for i in range(4)]
    tokens = [torch.tensor(100 * (i + 1), dtype=torch.int64) for i in range(4)]
    for step in range(1, 4):
        log.record("train", step, loss=losses[step - 1], tokens=tokens[step - 1], micro_batch=2)

    assert path.read_text() == ""
    assert [type(r["loss"]) for r in log.pending] == [torch.Tensor] * 3
    assert all(r["loss"] is losses[i] for i, r in enumerate(log.pending))
    assert counted_stacks == []

    log.record("train", 4, loss=losses[3], tokens=tokens[3], micro_batch=2)  # the 4th flushes
    assert counted_stacks == [8]  # 4 losses + 4 token counts, one stack
    written = _lines(path)
    assert [r["step"] for r in written] == [1, 2, 3, 4]
    assert [r["loss"] for r in written] == [2.5, 2.25, 2.0, 1.75]
    assert [r["tokens"] for r in written] == [100, 200, 300, 400]
    assert all(type(r["tokens"]) is int and r["micro_batch"] == 2 for r in written)
    assert log.pending == [] and log.last_flushed["step"] == 4
    log.close()


def test_bfloat16_values_and_grad_tensors_are_written_as_numbers(tmp_path):
    weight = torch.tensor(3.0, requires_grad=True)
    with MetricsLog(tmp_path / "m.jsonl", flush_every=1) as log:
        log.record("train", 1, loss=(weight * 2).to(torch.bfloat16), grad_norm=weight * 1.5)
    (record,) = read_metrics(tmp_path / "m.jsonl")
    assert record["loss"] == 6.0 and record["grad_norm"] == 4.5


def test_event_is_written_at_once_after_what_was_buffered(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, flush_every=100)
    log.record("train", 1, loss=torch.tensor(1.0))
    log.record("train", 2, loss=torch.tensor(0.5))
    log.event("batch", 2, old_micro_batch=4, new_micro_batch=2, reason="oom")
    assert [(r["kind"], r["step"]) for r in _lines(path)] == [("train", 1), ("train", 2), ("batch", 2)]
    log.close()


def test_file_is_valid_json_lines_after_every_flush(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, flush_every=2)
    for step in range(1, 8):
        log.record("train", step, loss=torch.tensor(float(step)), lr=1e-4)
        written = _lines(path)  # raises on any partial line
        assert len(written) == step // 2 * 2
        assert all({"kind", "step", "time"} <= r.keys() for r in written)
    log.close()
    assert len(_lines(path)) == 7


def test_non_finite_values_become_null_and_non_scalars_are_refused(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsLog(path, flush_every=1) as log:
        log.record("train", 1, loss=torch.tensor(float("nan")), loss_scale=float("inf"))
        with pytest.raises(ValueError, match="train.loss must be a scalar"):
            log.record("train", 2, loss=torch.ones(3))
    (record,) = _lines(path)
    assert record["loss"] is None and record["loss_scale"] is None


def test_read_metrics_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsLog(path, flush_every=1) as log:
        for step in (1, 2, 3):
            log.record("train", step, loss=torch.tensor(1.0 / step))
    with open(path, "a") as file:
        file.write('{"kind": "train", "step": 4, "lo')
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]

    # A resumed run appends after the torn line, starting a fresh line, so its records stay readable.
    with MetricsLog(path, flush_every=1) as log:
        log.record("train", 4, loss=torch.tensor(0.2))
    records, unreadable_lines = read_metrics_counted(path)
    assert [r["step"] for r in records] == [1, 2, 3, 4] and unreadable_lines == 1


def test_a_killed_process_leaves_every_flushed_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    script = textwrap.dedent(f"""
        import os, signal, torch
        from memtrain.monitor.metrics import MetricsLog
        log = MetricsLog({str(path)!r}, flush_every=2)
        for step in range(1, 6):
            log.record("train", step, loss=torch.tensor(float(step)))
        os.kill(os.getpid(), signal.SIGKILL)  # no close, no atexit: like the OOM killer
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == -9
    # Steps 1-4 were flushed; step 5 was still buffered when the process died.
    assert [r["loss"] for r in read_metrics(path)] == [1.0, 2.0, 3.0, 4.0]


def test_disabled_log_on_other_ranks_writes_nothing(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    log = MetricsLog(path, flush_every=1, tensorboard_dir=tmp_path / "tb", enabled=False)
    log.record("train", 1, loss=torch.tensor(1.0))
    log.event("run", 1, event="end", status="done")
    log.close()
    assert not path.exists() and not (tmp_path / "run").exists() and not (tmp_path / "tb").exists()
    assert log.pending == []


@pytest.mark.skipif(tensorboard_available(), reason="tensorboard is installed")
def test_without_tensorboard_the_log_runs_on_jsonl_alone(tmp_path):
    with MetricsLog(tmp_path / "metrics.jsonl", flush_every=1, tensorboard_dir=tmp_path / "tb") as log:
        log.record("train", 1, loss=torch.tensor(1.0))
    assert not (tmp_path / "tb").exists()
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 1


@pytest.mark.skipif(not tensorboard_available(), reason="needs the optional `tensorboard` package")
def test_with_tensorboard_scalars_land_in_event_files(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLog(tmp_path / "metrics.jsonl", flush_every=2, tensorboard_dir=tmp_path / "tb") as log:
        for step in (1, 2, 3):
            log.record("train", step, loss=torch.tensor(float(step)), note="text is skipped")
        log.event("eval", 3, loss=0.5, perplexity=1.6487)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert [e.step for e in events.Scalars("eval/perplexity")] == [3]
