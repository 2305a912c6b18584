"""StepProfiler: a Chrome trace of N steps after one warm-up, with named phases; a no-op at N == 0."""

from __future__ import annotations

import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memtrain.monitor.profiler import SUMMARY_FILE, TRACE_FILE, StepProfiler, phase


def _train(profiler: StepProfiler, steps: int) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=16,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = torch.randint(0, 256, (2, 16))
    with profiler:
        for _ in range(steps):
            with phase("forward"):
                loss = model(input_ids=batch, labels=batch).loss
            with phase("backward"):
                loss.backward()
            with phase("optimizer_step"):
                optimizer.step()
                optimizer.zero_grad()
            profiler.step()


def _user_ranges(trace: dict) -> list[str]:
    return [e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"]


def test_trace_holds_the_profiled_steps_and_their_phases(tmp_path):
    profiler = StepProfiler(tmp_path, steps=2, device="cpu")
    _train(profiler, steps=5)
    trace = json.loads((tmp_path / TRACE_FILE).read_text())
    names = _user_ranges(trace)
    # Warm-up step 0 is not in the trace; steps 1 and 2 are, then the profiler stopped.
    assert sorted(n for n in names if n.startswith("ProfilerStep#")) == ["ProfilerStep#1", "ProfilerStep#2"]
    for name in ("forward", "backward", "optimizer_step"):
        assert names.count(name) == 2, name
    assert not profiler.recording
    assert phase("forward") is phase("backward")  # back to the shared no-op after the profile
    summary = (tmp_path / SUMMARY_FILE).read_text()
    rows = {line.split()[0]: line.split() for line in summary.splitlines() if line.strip()}
    for name in ("forward", "backward", "optimizer_step", "aten::mm"):
        assert name in rows, name
    assert rows["forward"][-1] == "2"  # the "# of Calls" column: once per profiled step


def test_a_run_shorter_than_the_profile_still_writes_its_trace(tmp_path):
    _train(StepProfiler(tmp_path, steps=10, device="cpu"), steps=3)
    names = _user_ranges(json.loads((tmp_path / TRACE_FILE).read_text()))
    assert names.count("forward") == 2  # steps 1 and 2 after the warm-up


def test_zero_steps_records_nothing(tmp_path):
    profiler = StepProfiler(tmp_path, steps=0, device="cpu")
    assert not profiler.enabled
    _train(profiler, steps=2)
    assert not (tmp_path / TRACE_FILE).exists()
    assert not (tmp_path / SUMMARY_FILE).exists()
    assert list(tmp_path.iterdir()) == []
    assert phase("forward") is phase("backward")  # one shared do-nothing context
