"""`memtrain prepare`: the data tokenised into the cache and DeepSpeed's ops built ahead of a run, which then
tokenises and builds nothing; bad input and machines that cannot build an op exit 2 with the way around it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memtrain.cli import app
from memtrain.recipe.load import load_recipe_text
from memtrain.train.ops import deepspeed_ops
from memtrain.train.ops.deepspeed_ops import ASYNC_IO, CPU_ADAM, SHARED_MEMORY, ops_for
from memtrain.train.runtime.distributed import without_rank_variables


def _recipe(**offload):
    text = "model: {preset: micro, tokenizer: 'builtin:shakespeare'}\ndata: {train: 'builtin:shakespeare'}\n"
    if offload:
        nvme = "hardware: {nvme_path: /tmp}\n" if "nvme" in offload.values() else ""
        text += f"offload: {json.dumps(offload)}\n{nvme}"
    return load_recipe_text(text, "r.yaml", check=False).recipe


def test_the_ops_a_run_loads_follow_the_offload_tiers_and_the_machine():
    assert ops_for(_recipe(), on_gpu=True) == []
    assert ops_for(_recipe(), on_gpu=False) == [SHARED_MEMORY]  # DeepSpeed's CPU collectives
    assert ops_for(_recipe(optimizer="cpu"), on_gpu=True) == [CPU_ADAM]
    assert ops_for(_recipe(optimizer="cpu", cpu_adam="torch"), on_gpu=True) == []
    assert ops_for(_recipe(optimizer="nvme", params="cpu"), on_gpu=True) == [CPU_ADAM, ASYNC_IO]
    [*_, params_on_nvme] = ops_for(_recipe(optimizer="cpu", params="nvme"), on_gpu=True)
    assert params_on_nvme.name == "async_io" and params_on_nvme.key == "offload.params"


def _prepare(recipe: Path, *args: str) -> dict:
    result = CliRunner().invoke(app, ["prepare", str(recipe), *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_prepare_tokenises_once_and_says_so(write_recipe, tmp_path):
    recipe = write_recipe()
    first = _prepare(recipe)
    cache = tmp_path / "cache"
    assert first["data"]["cache_dir"] == str(cache) and first["data"]["tokenised_now"] == 2  # train and validation
    entries = {path: path.stat().st_mtime_ns for path in cache.glob("*.npy")}
    assert len(entries) == 4  # tokens and document ends of each
    assert first["machine"] == "cpu" and [op["name"] for op in first["ops"]] == ["deepspeed_shm_comm"]
    assert first["data"]["train"].startswith(f"{first['data']['train'].split()[0]} samples in ")
    second = _prepare(recipe)
    assert second["data"]["tokenised_now"] == 0
    assert second["ops"][0]["state"] in ("already built", "installed with DeepSpeed")
    assert {path: path.stat().st_mtime_ns for path in cache.glob("*.npy")} == entries
    assert not (tmp_path / "runs").exists()  # nothing but the caches


@pytest.mark.parametrize("command", ["prepare", "run"])
def test_an_op_this_machine_cannot_build_is_said_at_its_key_before_anything_is_built(
    command, write_recipe, tmp_path, monkeypatch
):
    class Builder:  # every op loads, but async I/O finds no libaio
        def __init__(self, op):
            self.op = op

        def is_compatible(self, verbose=False):
            return self.op.name != "async_io"

        def load(self):
            return None

    monkeypatch.setattr(deepspeed_ops, "_builder", Builder)
    recipe = write_recipe(
        "nvme", {"offload": {"params": "nvme", "optimizer": "nvme"}, "hardware": {"nvme_path": str(tmp_path / "nvme")}}
    )
    result = CliRunner().invoke(app, [command, str(recipe)])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert "DeepSpeed's async_io op, which reads and writes the NVMe tiers, cannot be built on this machine" in said
    assert "offload.optimizer" in said and "libaio-dev" in said and "Traceback" not in said
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()  # said before any work


def test_a_failed_build_is_one_line_naming_the_compiler_or_torch_adam(write_recipe, monkeypatch):
    class BrokenCompiler:
        def is_compatible(self, verbose=False):
            return True

        def load(self):
            raise RuntimeError("Error building extension 'cpu_adam'\n(the compiler's output)")

    monkeypatch.setattr(deepspeed_ops, "_builder", lambda op: BrokenCompiler())
    monkeypatch.setattr("memtrain.commands.prepare.machine_has_gpu", lambda: True)  # CPU Adam alone
    recipe = write_recipe("offload", {"offload": {"optimizer": "cpu"}})
    result = CliRunner().invoke(app, ["prepare", str(recipe)])
    assert result.exit_code == 2, result.output
    assert "Error building extension 'cpu_adam'" in result.output and "offload.cpu_adam=torch" in result.output
    assert "Traceback" not in result.output


def test_a_bad_recipe_exits_2_before_any_work(write_recipe, tmp_path):
    result = CliRunner().invoke(app, ["prepare", str(write_recipe()), "data.seq_len=-1"])
    assert result.exit_code == 2 and "data.seq_len" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_a_run_after_prepare_builds_and_tokenises_nothing(write_recipe, tmp_path):
    """On empty caches: prepare builds the CPU collectives and CPU Adam; the run that follows (its own process,
    as a user's would be) finds both and the tokens, and rewrites none of them."""
    recipe = write_recipe("offload", {"offload": {"optimizer": "cpu"}})
    extensions = tmp_path / "torch_extensions"
    env = {**without_rank_variables(os.environ), "TORCH_EXTENSIONS_DIR": str(extensions)}
    prepared = subprocess.run(
        [sys.executable, "-m", "memtrain", "prepare", str(recipe), "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    summary = json.loads(prepared.stdout)
    assert {op["name"]: op["state"] for op in summary["ops"]} == {
        "deepspeed_shm_comm": "built now",
        "cpu_adam": "built now",
    }

    def files() -> dict:  # the ops, the token-cache entries and the data files' remembered fingerprints
        cache = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
        return {path: path.stat().st_mtime_ns for path in [*extensions.glob("*/*.so"), *cache]}

    written = files()
    assert len([p for p in written if p.suffix == ".so"]) == 2 and len(list((tmp_path / "cache").glob("*.npy"))) == 4
    ran = subprocess.run(
        [sys.executable, "-m", "memtrain", "run", str(recipe), "--max-steps", "1", "--no-save"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert files() == written
    again = json.loads(
        subprocess.run(
            [sys.executable, "-m", "memtrain", "prepare", str(recipe), "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        ).stdout
    )
    assert [op["state"] for op in again["ops"]] == ["already built", "already built"]
    assert again["data"]["tokenised_now"] == 0
