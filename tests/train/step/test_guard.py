"""The guard on its own, with real tensors: when a divergence is reported, and what several ranks agree on
(one all-reduce over real gloo processes)."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch

from memtrain.monitor.metrics import MetricsLog
from memtrain.recipe.schema import Recipe
from memtrain.train.step.guard import DIVERGENCE_AFTER_STEPS, Guard
from tests.conftest import TINY_RECIPE


class Engine:
    """What the guard reads of a DeepSpeed engine: the count of updates its overflow check skipped."""

    skipped_steps = 0


def guard_for(tmp_path: Path, world_size: int = 1) -> tuple[Guard, Path]:
    path = tmp_path / "metrics.jsonl"
    guard = Guard(
        Recipe.model_validate(TINY_RECIPE), MetricsLog(path, flush_every=1), world_size, torch.device("cpu"), tmp_path
    )
    return guard, path


def feed(guard: Guard, losses: list[float], targets: int = 100) -> None:
    for step, loss in enumerate(losses, start=1):
        guard.after_step(step, torch.tensor(loss * targets), targets, Engine(), 0, None)


def divergences(path: Path) -> list[dict]:
    guard_records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in guard_records if r["kind"] == "divergence"]


def test_a_loss_that_blows_up_from_the_first_steps_is_reported_once_after_the_grace(tmp_path):
    """optimizer.lr=0.9 on the quickstart: 8.4 at step 1, far above from step 2 on."""
    guard, path = guard_for(tmp_path)
    feed(guard, [8.4, 69.3, 150.0, 259.7, 200.0, 120.0, 95.0, 82.2, 90.0, 85.0])
    guard.metrics.flush()
    [event] = divergences(path)
    assert event["step"] == DIVERGENCE_AFTER_STEPS + 1 and event["best_loss"] == pytest.approx(8.4)
    assert guard.warning and "far above its best 8.4" in guard.warning and "optimizer.lr" in guard.warning


def test_noise_in_the_grace_steps_and_a_falling_loss_warn_of_nothing(tmp_path):
    guard, path = guard_for(tmp_path)
    feed(guard, [8.0, 14.0, 9.0, 7.0, 6.5, 6.0, 5.5, 5.0, 4.8, 4.7])  # step 2 is far, then training recovers
    guard.metrics.flush()
    assert divergences(path) == [] and guard.warning is None


def test_a_rise_after_the_grace_is_one_event_per_episode(tmp_path):
    guard, path = guard_for(tmp_path)
    feed(guard, [8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 9.0, 9.5, 3.1, 9.0])
    guard.metrics.flush()
    assert [e["step"] for e in divergences(path)] == [7, 10]  # 7-8 one episode, back at 9, again at 10


def test_a_resumed_guard_warns_as_the_uninterrupted_one_does(tmp_path):
    """The guard's best loss was not saved: after a stop at step 8 of a rising loss, the resumed run took 9.0 as its
    best (and a new grace) and said nothing, where the uninterrupted run reported the rise at step 9."""
    losses = [8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 3.1, 3.2, 9.0, 9.5]
    whole, whole_path = guard_for(tmp_path / "whole")
    feed(whole, losses)
    before, _ = guard_for(tmp_path / "before")
    feed(before, losses[:8])
    saved = json.loads(json.dumps(before.state_dict()))  # as state.json carries it
    path = tmp_path / "after" / "metrics.jsonl"
    after = Guard(
        Recipe.model_validate(TINY_RECIPE),
        MetricsLog(path, flush_every=1),
        1,
        torch.device("cpu"),
        tmp_path / "after",
        saved,
    )
    for step, loss in enumerate(losses[8:], start=9):
        after.after_step(step, torch.tensor(loss * 100), 100, Engine(), 0, None)
    whole.metrics.flush()
    after.metrics.flush()
    assert [e["step"] for e in divergences(path)] == [e["step"] for e in divergences(whole_path)] == [9]
    assert after.warning == whole.warning


def _agree_on_two_ranks(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        guard, _ = guard_for(Path(out) / f"rank{rank}", world_size=2)
        targets = 10
        shares = [torch.tensor(31.0), torch.tensor(29.0)]  # each rank's token-loss sum over its half
        asked = [None, signal.SIGTERM]  # only rank 1 got a signal (SIGTERM, as from Slurm)
        verdict = guard.after_step(1, shares[rank], targets, Engine(), 0, asked[rank])
        both = [None, signal.SIGINT]
        later = guard.after_step(2, shares[rank], targets, Engine(), 0, [signal.SIGTERM, signal.SIGINT][rank])
        nan = guard.after_step(3, torch.tensor(math.nan) if rank == 1 else shares[0], targets, Engine(), 0, both[rank])
        (Path(out) / f"rank{rank}.json").write_text(
            json.dumps(
                {
                    "first": [verdict.stop, verdict.signum, float(verdict.loss), verdict.bad],
                    "both": [later.signum],
                    "nan": [nan.bad, nan.signum],
                }
            )
        )
    finally:
        dist.destroy_process_group()


def test_two_ranks_agree_on_the_stop_signal_and_log_the_global_batch_loss(tmp_path):
    """A rank that got no signal stops with the other's SIGTERM (exit 143 everywhere), and
    the loss is the whole batch's mean, not rank 0's share."""
    import torch.multiprocessing as mp

    from memtrain.train.runtime.distributed import free_port

    for rank in range(2):
        (tmp_path / f"rank{rank}").mkdir()
    mp.spawn(_agree_on_two_ranks, args=(free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        said = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert said["first"] == [True, signal.SIGTERM, pytest.approx(6.0), False], (rank, said)
        assert said["both"] == [signal.SIGTERM]  # SIGTERM on one rank and Ctrl-C on the other: SIGTERM wins
        assert said["nan"] == [True, signal.SIGINT]  # one rank's NaN loss is a bad step on every rank


def test_the_nan_and_divergence_messages_weigh_a_damaged_input_when_the_cache_check_found_one(tmp_path, monkeypatch):
    """A zero-filled token cache passed the data check and the NaN / divergence message then blamed the learning rate
    alone."""
    from memtrain.data.tokens import cache

    guard, _ = guard_for(tmp_path)
    monkeypatch.setattr(
        cache, "_found_damaged", []
    )  # the process's list: other tests' damaged caches are not this run's
    assert "damaged input" not in guard.likely_cause()
    monkeypatch.setattr(cache, "_found_damaged", ["/c/ab12: holds other bytes in ab12.tokens.npy"])
    assert "optimizer.lr" in guard.likely_cause() and "or a damaged input: 1 token cache entry" in guard.likely_cause()
    feed(guard, [8.4, 69.3, 150.0, 259.7, 200.0, 120.0, 95.0])
    assert "far above its best" in guard.warning and "check the data files" in guard.warning


def test_a_preference_objective_watches_its_noisy_loss_through_a_moving_average(tmp_path):
    """A DPO step's loss over 16 pairs swings between batches (0.1 after 1.3 is noise): SFT's reading would warn, the
    preference guard's moving average does not; a loss that rises and stays is still reported, resumed or not."""
    noisy = [0.69, 0.6, 0.5, 0.3, 0.1, 0.4, 0.2, 1.3, 0.15, 0.9, 0.05, 1.4, 0.3]
    sft, sft_path = guard_for(tmp_path / "sft")
    feed(sft, noisy)
    sft.metrics.flush()
    assert divergences(sft_path)  # the raw reading: 1.3 is far above 0.1

    dpo_recipe = Recipe.model_validate({**TINY_RECIPE, "train": {**TINY_RECIPE.get("train", {}), "objective": "dpo"}})

    def dpo_guard(directory: Path, saved: dict | None = None) -> tuple[Guard, Path]:
        path = directory / "metrics.jsonl"
        return Guard(dpo_recipe, MetricsLog(path, flush_every=1), 1, torch.device("cpu"), directory, saved), path

    quiet, quiet_path = dpo_guard(tmp_path / "dpo")
    feed(quiet, noisy)
    quiet.metrics.flush()
    assert divergences(quiet_path) == [] and quiet.warning is None

    rising = noisy + [3.0] * 12
    whole, whole_path = dpo_guard(tmp_path / "whole")
    feed(whole, rising)
    whole.metrics.flush()
    [event] = divergences(whole_path)
    assert len(noisy) < event["step"] <= len(noisy) + 5 and "moving average" in whole.warning
    before, _ = dpo_guard(tmp_path / "before")
    feed(before, rising[:14])
    after, after_path = dpo_guard(tmp_path / "after", json.loads(json.dumps(before.state_dict())))
    for step, loss in enumerate(rising[14:], start=15):
        after.after_step(step, torch.tensor(loss * 100), 100, Engine(), 0, None)
    after.metrics.flush()
    assert [e["step"] for e in divergences(after_path)] == [event["step"]] and after.warning == whole.warning
