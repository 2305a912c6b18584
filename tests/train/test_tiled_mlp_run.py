"""checkpointing.mlp_tiles under DeepSpeed ZeRO-2 and ZeRO-3 on the CPU: the same losses step by step as untiled."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from memtrain.commands.run import run_command
from tests.conftest import train_losses

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("stage", "extra"),
    [
        (2, {"batch": {"micro_batch": 2}}),  # two micro-batches per step: the tiles' gradients accumulate across them
        (
            2,
            {
                "model": {"lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
                "checkpointing": {"strategy": "every_layer", "offload_inputs": True},
            },
        ),
        (3, {}),  # each tile's recompute in backward gathers the partitioned MLP weights again
    ],
    ids=["zero2-full-accumulated", "zero2-lora-recomputed-inputs-on-host", "zero3-full"],
)
def test_tiled_mlps_train_like_untiled_ones_under_zero(write_recipe, monkeypatch, stage, extra):
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    calls = []
    forward = TiledMLP.forward
    monkeypatch.setattr(
        TiledMLP, "forward", staticmethod(lambda ctx, *args: calls.append(args[3]) or forward(ctx, *args))
    )
    base = {**extra, "offload": {"zero_stage": stage}, "train": {"steps": 4, "eval_every": 100, "save_every": 100}}
    untiled = write_recipe("untiled", base)
    # 32 tokens in 3 tiles: 11, 11 and 10
    tiled = write_recipe("tiled", {**base, "checkpointing": {**base.get("checkpointing", {}), "mlp_tiles": 3}})
    assert run_command(untiled, []) == 0
    assert calls == []
    assert run_command(tiled, []) == 0
    assert calls and set(calls) == {3}  # every MLP went through DeepSpeed's tiled function
    a, b = (train_losses(Path(yaml.safe_load(p.read_text())["train"]["output_dir"])) for p in (untiled, tiled))
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert b[step] == pytest.approx(a[step], abs=1e-5), step
    assert a[4] < a[1]  # it trained, so the weights (and the tiles' gradients) moved alike
