"""The recipe -> DeepSpeed compiler: golden files for every shipped recipe, DeepSpeed's own parser
accepts every output, and the decisions (stage, offload blocks, batch split, precision) follow the recipe."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from memtrain.ds_config.compiler import ds_config, ds_config_for_shapes
from memtrain.plan.planner import resolve_micro_batch
from memtrain.plan.zero import grad_accum_steps
from memtrain.recipe.load import load_recipe, load_recipe_text

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
GOLDEN = Path(__file__).parent / "golden"


def compiled(path: Path) -> dict:
    """The config a run compiles: `micro_batch: auto` resolved by the planner, as resolve_run does."""
    recipe = load_recipe(path).recipe
    micro_batch = recipe.batch.micro_batch
    return ds_config(recipe, micro_batch=resolve_micro_batch(recipe) if micro_batch == "auto" else micro_batch)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_compiled_config_matches_golden_file(path):
    config = compiled(path)
    golden = GOLDEN / f"{path.stem}.json"
    if os.environ.get("MEMTRAIN_UPDATE_GOLDEN") or not golden.exists():
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if not os.environ.get("MEMTRAIN_UPDATE_GOLDEN"):
            pytest.fail(f"wrote missing golden file {golden}; review and commit it")
    assert config == json.loads(golden.read_text())


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_deepspeed_accepts_every_compiled_config(path, monkeypatch):
    import deepspeed.comm as ds_comm
    from deepspeed.runtime.config import DeepSpeedConfig

    config = compiled(path)
    world = load_recipe(path).recipe.hardware.gpus
    # DeepSpeed reads the data-parallel world size from the process group; pretend to be rank 0 of `world`
    monkeypatch.setattr(ds_comm, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(ds_comm, "get_world_size", lambda *a, **k: world)
    parsed = DeepSpeedConfig(config)
    assert parsed.train_batch_size == config["train_batch_size"]
    assert parsed.zero_optimization_stage == config["zero_optimization"]["stage"]
    assert parsed.gradient_accumulation_steps == config["gradient_accumulation_steps"]
    assert parsed.managed_gradient_accumulation  # the loop marks boundaries (memtrain.train.step.micro_batches)


BASE = """
model: {preset: tiny}
data: {train: "builtin:shakespeare", seq_len: 64}
train: {steps: 10}
"""


def recipe_with(extra: str = "", overrides: list[str] | None = None):
    return load_recipe_text(BASE + extra, overrides=overrides).recipe


def test_stage_follows_offload_tiers_and_gpus():
    assert recipe_with().zero_stage == 2
    # LoRA on one GPU that holds everything: nothing to partition, gradients reduced once a step, not per micro-batch
    lora = ["model.lora.r=4"]
    assert recipe_with(overrides=lora).zero_stage == 1
    assert recipe_with(overrides=lora + ["precision.master=bf16"]).zero_stage == 1
    assert recipe_with(overrides=lora + ["hardware.gpus=2", "batch.global_batch=8"]).zero_stage == 2
    assert recipe_with(overrides=lora + ["hardware.nodes=2", "batch.global_batch=8"]).zero_stage == 2
    assert recipe_with(overrides=lora + ["offload.optimizer=cpu"]).zero_stage == 2
    assert recipe_with(overrides=["offload.optimizer=cpu"]).zero_stage == 2
    assert recipe_with(overrides=["offload.optimizer=cpu", "offload.params=cpu"]).zero_stage == 3
    assert recipe_with(overrides=["offload.zero_stage=0", "precision.compute=fp32"]).zero_stage == 0
    assert recipe_with(overrides=["offload.zero_stage=2"]).zero_stage == 2
    # only ZeRO-3 swaps optimizer states to NVMe (DeepSpeed's ZeRO-1/2 optimizer keeps them in host memory)
    assert recipe_with(overrides=["offload.optimizer=nvme", "hardware.nvme_path=/tmp"]).zero_stage == 3


def test_offload_blocks_and_nvme_paths(tmp_path):
    recipe = recipe_with(overrides=["offload.optimizer=nvme", "offload.params=nvme", f"hardware.nvme_path={tmp_path}"])
    config = ds_config_for_shapes(recipe, hidden_size=256, micro_batch=4)
    zero = config["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"]["device"] == "nvme" and zero["offload_optimizer"]["nvme_path"] == str(tmp_path)
    assert zero["offload_param"]["device"] == "nvme" and zero["offload_param"]["nvme_path"] == str(tmp_path)
    assert config["aio"]["queue_depth"] == recipe.offload.aio.queue_depth
    assert "aio" not in ds_config_for_shapes(recipe_with(), 256, 4)


def test_bucket_sizes_derive_from_hidden_size():
    recipe = recipe_with(overrides=["offload.optimizer=cpu", "offload.params=cpu"])
    zero = ds_config_for_shapes(recipe, hidden_size=4096, micro_batch=4)["zero_optimization"]
    assert zero["reduce_bucket_size"] == 4096 * 4096
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 4096 * 4096)
    assert zero["stage3_param_persistence_threshold"] == 40960


@pytest.mark.parametrize("global_batch,micro,gpus,accum", [(32, 4, 1, 8), (32, 4, 2, 4), (16, 16, 1, 1), (30, 4, 1, 8)])
def test_batch_split(global_batch, micro, gpus, accum):
    assert grad_accum_steps(global_batch, micro, gpus) == accum


def test_precision_blocks():
    bf16 = ds_config_for_shapes(recipe_with(overrides=["precision.master=bf16"]), 256, 4)
    assert bf16["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    fp16 = ds_config_for_shapes(
        recipe_with(
            overrides=[
                "precision.compute=fp16",
                "precision.loss_scale.initial_scale_power=12",
                "precision.loss_scale.hysteresis=3",
            ]
        ),
        256,
        4,
    )
    assert fp16["fp16"]["enabled"] and fp16["fp16"]["loss_scale"] == 0
    assert fp16["fp16"]["initial_scale_power"] == 12 and fp16["fp16"]["hysteresis"] == 3
    assert "bf16" not in fp16
    fp32 = ds_config_for_shapes(recipe_with(overrides=["precision.compute=fp32"]), 256, 4)
    assert "bf16" not in fp32 and "fp16" not in fp32


def test_compiler_is_pure():
    recipe = recipe_with()
    before = recipe.model_dump()
    assert ds_config_for_shapes(recipe, 256, 4) == ds_config_for_shapes(recipe, 256, 4)
    assert recipe.model_dump() == before


def test_the_compile_command_writes_the_golden_config(tmp_path):
    from typer.testing import CliRunner

    from memtrain.cli import app

    out = tmp_path / "ds_config.json"
    result = CliRunner().invoke(app, ["compile", str(ROOT / "recipes" / "quickstart.yaml"), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text()) == json.loads((GOLDEN / "quickstart.json").read_text())
    printed = CliRunner().invoke(app, ["compile", str(ROOT / "recipes" / "quickstart.yaml"), "batch.micro_batch=4"])
    assert printed.exit_code == 0 and json.loads(printed.stdout)["gradient_accumulation_steps"] == 4


def test_compile_resolves_auto_micro_batch_and_epochs(tmp_path):
    from typer.testing import CliRunner

    from memtrain.cli import app

    result = CliRunner().invoke(
        app,
        [
            "compile",
            str(ROOT / "recipes" / "tinyllama-1.1b-full-offload-24gb.yaml"),
            "batch.micro_batch=auto",
            "train.steps=null",
            "train.epochs=1",
        ],
    )
    assert result.exit_code == 0, result.output
    config = json.loads(result.stdout)
    micro = config["train_micro_batch_size_per_gpu"]
    assert isinstance(micro, int) and 1 <= micro <= 16
    assert config["gradient_accumulation_steps"] * micro == 16


def test_an_optimizer_on_the_device_is_torch_fused_adamw():
    """Nothing to JIT-compile at start-up: DeepSpeed builds torch's fused AdamW from the compiled config."""
    import deepspeed
    import torch

    from memtrain.train.runtime.distributed import free_port

    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    config = ds_config_for_shapes(recipe_with(overrides=["precision.compute=fp32"]), 256, 4)
    assert config["optimizer"]["params"]["fused"] is True
    model = torch.nn.Linear(8, 8)
    engine, optimizer, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    inner = getattr(optimizer, "optimizer", optimizer)
    assert type(inner) is torch.optim.AdamW and inner.defaults["fused"] is True
    offloaded = ds_config_for_shapes(recipe_with(overrides=["offload.optimizer=cpu"]), 256, 4)
    assert "torch_adam" not in offloaded["optimizer"]["params"]  # DeepSpeed's CPU Adam


def test_an_output_path_through_a_file_is_a_user_error_not_a_traceback(tmp_path):
    from typer.testing import CliRunner

    from memtrain.cli import app

    (tmp_path / "chat.yaml").write_text("mine")
    result = CliRunner().invoke(
        app, ["compile", str(ROOT / "recipes" / "quickstart.yaml"), "-o", str(tmp_path / "chat.yaml" / "ds.json")]
    )
    assert result.exit_code == 2, result.output
    assert "is a file, where a directory is needed" in result.output and "Traceback" not in result.output
    assert (tmp_path / "chat.yaml").read_text() == "mine"
