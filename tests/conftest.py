"""Shared test setup: DeepSpeed on its CPU accelerator, and helpers to write and run tiny recipes."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]

# CI's machine stops the whole job at its time limit and prints nothing of pytest's summary. With a budget
# (MEMTRAIN_TEST_BUDGET_S, set by .ci/run below that limit) the session stops starting tests once it is
# spent, so the failures so far and the slowest tests (--durations) are still printed.
_STARTED = time.monotonic()
_BUDGET_S = float(os.environ.get("MEMTRAIN_TEST_BUDGET_S") or 0)


def _loop_s() -> float:
    """Seconds for ten million steps of a Python loop: ~0.7 s on the 2-core development machine."""
    started = time.perf_counter()
    sum(i * i for i in range(10_000_000))
    return time.perf_counter() - started


_LOOP_AT_START_S = _loop_s() if _BUDGET_S else None


def pytest_terminal_summary(terminalreporter):
    """Under a budget (CI), the machine the run had, at the end of the output where CI's excerpt shows it."""
    if _LOOP_AT_START_S is None:
        return
    from memtrain.train.runtime.distributed import cgroup_cpu_quota, usable_cpus  # noqa: PLC0415 — only under a budget, at the end

    terminalreporter.write_line(
        f"machine: os.cpu_count {os.cpu_count()}, usable {usable_cpus()} (cgroup quota {cgroup_cpu_quota()}), "
        f"load {' '.join(Path('/proc/loadavg').read_text().split()[:3])}, python loop {_LOOP_AT_START_S:.2f} s at the "
        f"start and {_loop_s():.2f} s at the end, {time.monotonic() - _STARTED:.0f} s in pytest"
    )


def pytest_runtest_teardown(item, nextitem):
    spent = time.monotonic() - _STARTED
    if _BUDGET_S and nextitem is not None and spent > _BUDGET_S:
        item.session.shouldstop = (
            f"the test budget MEMTRAIN_TEST_BUDGET_S={_BUDGET_S:.0f} s is spent "
            f"({spent:.0f} s); the tests after {item.nodeid} did not run"
        )


# A recipe small enough to train in seconds on two CPU cores, on the bundled Shakespeare.
TINY_RECIPE = {
    "model": {"preset": "micro", "tokenizer": "builtin:shakespeare"},
    "data": {"train": "builtin:shakespeare", "validation": "builtin:shakespeare/validation", "seq_len": 32},
    "hardware": {"gpus": 1},
    "checkpointing": {"strategy": "none"},
    "precision": {"compute": "fp32"},
    "batch": {"global_batch": 8, "micro_batch": 4},
    "optimizer": {"lr": 3.0e-3},
    "schedule": {"warmup_steps": 2, "decay": "cosine"},
    "train": {"steps": 10, "eval_every": 5, "eval_batches": 2, "save_every": 5, "log_every": 1, "seed": 7},
}


def deep_update(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = deep_update(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@pytest.fixture
def write_recipe(tmp_path):
    """write_recipe(name, {section: {...}}) -> path of a tiny recipe whose run dir is under tmp_path."""

    def write(name: str = "tiny", extra: dict | None = None) -> Path:
        recipe = deep_update(TINY_RECIPE, extra or {})
        recipe = deep_update(
            recipe,
            {"train": {"output_dir": str(tmp_path / "runs" / name)}, "data": {"cache_dir": str(tmp_path / "cache")}},
        )
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        return path

    return write


@pytest.fixture(scope="session")
def process_group():
    """This process as a one-rank DeepSpeed group on its device (gloo on the CPU), as a run sets it up."""
    from memtrain.train.runtime.distributed import setup_process

    place, _ = setup_process("rtx3090", cap_memory=False)
    return place


def read_records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_records(run_dir, "train")}


def saved_for_backward_bytes(run, skip=()) -> int:
    """Bytes autograd keeps for backward while `run()` runs: each storage once, those of the tensors in
    `skip` (parameters, shared tables) left out."""
    import torch

    skipped = {t.untyped_storage().data_ptr() for t in skip}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skipped:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(saved.values())


def lora_layer_saved_bytes(model, micro_batch: int, seq_len: int) -> int:
    """What one real decoder layer of a recipe's LoRA model keeps for backward on the CPU in bf16, built
    the way the planner traces it (adapters in the compute dtype, training mode), random weights."""
    import torch

    from memtrain.plan.activations import _layer_and_rotary, _with_lora, one_layer_model

    lm = _with_lora(one_layer_model(model, torch.bfloat16), model, torch.bfloat16).to_empty(device="cpu")
    lm.train()
    for p in lm.parameters():
        torch.nn.init.normal_(p, std=0.02)
    layer, rotary = _layer_and_rotary(lm)
    x = torch.randn(micro_batch, seq_len, lm.config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(seq_len).unsqueeze(0).expand(micro_batch, -1)
    cos_sin = tuple(t.to(torch.bfloat16) for t in rotary(x, positions))
    return saved_for_backward_bytes(
        lambda: layer(x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin),
        skip=[*layer.parameters(), *cos_sin],
    )


from tests.hub_cache import hub_cache  # noqa: E402, F401 — the fixture: a Hugging Face cache read offline
