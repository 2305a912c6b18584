"""A LoRA run's checkpoints leave the frozen base out and record it; a resume checks it is the same base.

Real runs on DeepSpeed's CPU accelerator with the micro Llama; the saved files are read back with torch.load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from memtrain.commands.run import run_command
from memtrain.errors import UserError
from memtrain.train.resolve import RunOptions
from memtrain.train.state.checkpoint import DS_TAG, latest_checkpoint
from memtrain.train.state.frozen_base import (
    FROZEN_BASE_FILE,
    SAMPLES,
    base_problem,
    fingerprint,
    module_problem,
    sample_positions,
)
from memtrain.train.state.manifest import MANIFEST_FILE
from tests.conftest import train_losses

LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj", "gate_proj", "down_proj"]}
STEPS = {"train": {"steps": 8, "save_every": 4, "eval_every": 100}}


def run(path: Path, *overrides: str, **options) -> int:
    return run_command(path, list(overrides), RunOptions(**options))


def run_dir_of(recipe: Path) -> Path:
    import yaml

    return Path(yaml.safe_load(recipe.read_text())["train"]["output_dir"])


def module_states(checkpoint: Path) -> dict:
    [path] = (checkpoint / DS_TAG).glob("*model_states.pt")
    return torch.load(path, map_location="cpu", weights_only=False)


def micro_model(seed: int):
    from transformers import AutoModelForCausalLM

    from memtrain.model.config import model_config
    from memtrain.recipe.schema import Model

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(model_config(Model(preset="micro")))


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
def test_a_lora_checkpoint_holds_only_the_adapters_and_records_the_base(write_recipe, monkeypatch, stage):
    lora = write_recipe("lora", {"model": {"lora": LORA}, "offload": {"zero_stage": stage}, **STEPS})
    assert run(lora, max_steps=4) == 0
    checkpoint = latest_checkpoint(run_dir_of(lora))
    saved = module_states(checkpoint)
    base = micro_model(0)
    frozen_bytes = tensor_bytes(base.parameters())
    # only the adapters: every tensor of the module is a lora_A / lora_B, none of the base's (nor a second copy in
    # DeepSpeed's frozen_param_fragments, which ZeRO-2 writes beside the module when it saves frozen parameters)
    assert saved["module"] and all(".lora_A." in key or ".lora_B." in key for key in saved["module"])
    assert saved.get("frozen_param_fragments") is None
    adapters = tensor_bytes(saved["module"].values())
    assert 0 < adapters < frozen_bytes / 10
    recorded = json.loads((checkpoint / FROZEN_BASE_FILE).read_text())
    assert len(recorded["tensors"]) == len(list(base.parameters()))  # every base weight, the adapters left out
    assert all(".lora_" not in name for name in recorded["tensors"])
    assert FROZEN_BASE_FILE in json.loads((checkpoint / MANIFEST_FILE).read_text())["files"]

    # the same run saving the whole module, as before: far larger
    from memtrain.train.state import checkpoint as checkpoints

    full = write_recipe("whole", {"model": {"lora": LORA}, "offload": {"zero_stage": stage}, **STEPS})
    with monkeypatch.context() as patch:
        patch.setattr(checkpoints, "has_frozen_parameters", lambda module: False)
        assert run(full, max_steps=4) == 0
    whole = latest_checkpoint(run_dir_of(full))
    size = sum(p.stat().st_size for p in (checkpoint / DS_TAG).iterdir())
    size_whole = sum(p.stat().st_size for p in (whole / DS_TAG).iterdir())
    assert size_whole - size >= frozen_bytes  # the base is what left, at least once
    print(f"ZeRO-{stage}: {size:,} bytes against {size_whole:,} with the base, which holds {frozen_bytes:,}")
    assert size < size_whole / 3, (size, size_whole)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_lora_run_stopped_and_resumed_equals_the_straight_run(write_recipe, stage):
    extra = {"model": {"lora": LORA}, "offload": {"zero_stage": stage}, "optimizer": {"lr": 3.0e-2}, **STEPS}
    straight = write_recipe("straight", extra)
    assert run(straight) == 0
    halves = write_recipe("halves", extra)
    assert run(halves, max_steps=4) == 0
    assert (latest_checkpoint(run_dir_of(halves)) / FROZEN_BASE_FILE).is_file()
    assert run(halves) == 0
    a, b = train_losses(run_dir_of(straight)), train_losses(run_dir_of(halves))
    assert sorted(b) == list(range(1, 9))
    for step in range(1, 9):
        assert b[step] == pytest.approx(a[step], abs=1e-6), step
    assert a[8] < a[1] - 0.05  # the adapters trained: the resumed steps were no no-ops
    assert (run_dir_of(halves) / "final" / "adapter_config.json").is_file()  # the export still writes the adapter


@pytest.mark.slow
def test_resuming_over_another_base_of_the_same_files_refuses_and_names_the_tensors(write_recipe, tmp_path):
    base_dir = tmp_path / "base"
    micro_model(0).save_pretrained(base_dir)
    extra = {"model": {"preset": None, "path": str(base_dir), "lora": LORA}, **STEPS}
    recipe = write_recipe("based", extra)
    assert run(recipe, max_steps=4) == 0
    sizes = {p.name: p.stat().st_size for p in base_dir.iterdir()}
    micro_model(1).save_pretrained(base_dir)  # another base in the same files, of the same sizes
    assert {p.name: p.stat().st_size for p in base_dir.iterdir()} == sizes
    with pytest.raises(UserError) as refused:
        run(recipe)
    text = "\n".join(problem.format() for problem in refused.value.problems)
    assert text.startswith("model.path: the frozen base weights differ from those checkpoint step-000004 was")
    # the base's norms start at one in both: only the weights drawn at random differ
    assert "16 of 21 frozen tensors hold other values (model.base_model.model.model.embed_tokens.weight, " in text
    assert "point the recipe at the base the run was trained on" in text
    assert "cannot resume" in text and "--no-resume --overwrite" in text
    assert sorted(train_losses(run_dir_of(recipe))) == [1, 2, 3, 4]  # nothing trained over the wrong base

    micro_model(0).save_pretrained(base_dir)  # the base put back: the run resumes
    assert run(recipe) == 0
    assert sorted(train_losses(run_dir_of(recipe))) == list(range(1, 9))


@pytest.mark.slow
def test_the_refusal_exits_2_with_one_line_and_no_traceback(write_recipe, tmp_path):
    import subprocess
    import sys

    from tests.train.test_run import clean_env

    base_dir = tmp_path / "base"
    micro_model(0).save_pretrained(base_dir)
    recipe = write_recipe("based", {"model": {"preset": None, "path": str(base_dir), "lora": LORA}, **STEPS})
    assert run(recipe, max_steps=4) == 0
    micro_model(1).save_pretrained(base_dir)
    done = subprocess.run(
        [sys.executable, "-m", "memtrain", "run", str(recipe)], env=clean_env(), capture_output=True, text=True
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "the frozen base weights differ" in done.stderr


@pytest.mark.slow
def test_a_full_fine_tune_saves_the_whole_module_as_before(write_recipe):
    recipe = write_recipe("full", STEPS)
    assert run(recipe, max_steps=4) == 0
    checkpoint = latest_checkpoint(run_dir_of(recipe))
    assert not (checkpoint / FROZEN_BASE_FILE).exists()
    saved = module_states(checkpoint)["module"]
    assert set(saved) == {f"model.{key}" for key in micro_model(0).state_dict()}  # the wrapper's prefix


def record(tensors: dict) -> dict:
    return {"scheme": f"sampled-{SAMPLES}-sha256", "tensors": tensors}


def entry(digest: str, shape=(4, 4), dtype="float32") -> dict:
    return {"shape": list(shape), "dtype": dtype, "digest": digest}


def test_the_same_base_passes_and_another_says_what_differs():
    checkpoint = Path("runs/x/checkpoints/step-000010")
    old = record({"a.weight": entry("1"), "b.weight": entry("2")})
    assert base_problem(old, old, checkpoint) is None
    values = base_problem(old, record({"a.weight": entry("1"), "b.weight": entry("3")}), checkpoint, "model.path")
    assert values.key == "model.path" and "1 of 2 frozen tensors hold other values (b.weight)" in values.message
    layout = base_problem(old, record({"a.weight": entry("1", dtype="uint8"), "b.weight": entry("2")}), checkpoint)
    assert "a.weight was float32 [4, 4], is uint8 [4, 4]" in layout.message
    others = base_problem(old, record({"a.weight": entry("1"), "c.weight": entry("2")}), checkpoint)
    assert "1 gone (b.weight); 1 new (c.weight)" in others.message


def test_a_checkpoint_must_lack_exactly_the_frozen_parameters():
    checkpoint = Path("step-000010")
    model = {"base.weight", "lora_A.weight", "lora_B.weight", "base.weight.absmax"}
    frozen = {"base.weight"}
    # a quantised base's constants are in both: saved beside the adapters, and in the model's state dict
    assert module_problem(model - frozen, model, frozen, checkpoint) is None
    missing = module_problem({"lora_A.weight", "base.weight.absmax"}, model, frozen, checkpoint)
    assert "1 trained tensors missing from the checkpoint (lora_B.weight)" in missing.message
    extra = module_problem(model - frozen | {"other.weight"}, model, frozen, checkpoint)
    assert "1 tensors this model does not have (other.weight)" in extra.message
    saved_frozen = module_problem(model, model, frozen, checkpoint)
    assert "1 frozen tensors saved in it (base.weight)" in saved_frozen.message


QLORA = {
    "model": {"quantize": {"type": "nf4"}, "lora": LORA},
    "checkpointing": {"strategy": "every_layer"},
    "precision": {"compute": "bf16"},
    "optimizer": {"lr": 3.0e-2},
    **STEPS,
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_a_qlora_run_saves_the_adapters_and_the_scales_and_resumes_exactly(write_recipe, kind):
    """bitsandbytes quantises on the CPU too: the packed base stays out, the scales it adds to the state dict stay
    in (and are fingerprinted), and a resume over the model quantised again continues exactly."""
    pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (pip install -e .[dev])")
    extra = {**QLORA, "model": {**QLORA["model"], "quantize": {"type": kind}}}
    straight = write_recipe("straight", extra)
    assert run(straight) == 0
    halves = write_recipe("halves", extra)
    assert run(halves, max_steps=4) == 0
    checkpoint = latest_checkpoint(run_dir_of(halves))
    saved = module_states(checkpoint)["module"]
    tensors = {key: value for key, value in saved.items() if isinstance(value, torch.Tensor)}
    adapters = {key for key in tensors if ".lora_A." in key or ".lora_B." in key}
    scales = set(tensors) - adapters
    assert adapters and scales and not any(key.endswith(".weight") for key in scales)  # no packed weight
    suffixes = {key.rsplit(".", 1)[1] for key in scales}
    assert suffixes <= (
        {"SCB", "weight_format"}
        if kind == "int8"
        else {"absmax", "quant_map", "nested_absmax", "nested_quant_map", "bitsandbytes__nf4"}
    )
    recorded = json.loads((checkpoint / FROZEN_BASE_FILE).read_text())["tensors"]
    assert scales <= set(recorded)  # the scales are fingerprinted with the frozen weights
    assert run(halves) == 0
    a, b = train_losses(run_dir_of(straight)), train_losses(run_dir_of(halves))
    assert sorted(b) == list(range(1, 9))
    for step in range(1, 9):
        assert b[step] == pytest.approx(a[step], abs=1e-6), step


@pytest.mark.slow
def test_two_zero3_ranks_record_one_base_and_a_stopped_run_resumes_exactly(write_recipe):
    """Under ZeRO-3 each rank holds a partition of every frozen tensor: their digests are combined into one record."""
    import subprocess
    import sys

    from tests.train.test_run import clean_env

    extra = {
        "model": {"lora": LORA},
        "offload": {"zero_stage": 3},
        "hardware": {"gpus": 2},
        "optimizer": {"lr": 3.0e-2},
        **STEPS,
    }

    def launched(recipe: Path, *flags: str) -> None:
        command = [sys.executable, "-m", "memtrain", "run", str(recipe), *flags]
        done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=clean_env(OMP_NUM_THREADS="1"))
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    straight, halves = write_recipe("straight", extra), write_recipe("halves", extra)
    launched(straight)
    launched(halves, "--max-steps", "4")
    recorded = json.loads((latest_checkpoint(run_dir_of(halves)) / FROZEN_BASE_FILE).read_text())["tensors"]
    assert len(recorded) == len(list(micro_model(0).parameters()))
    shapes = {name.rsplit("model.", 1)[-1]: entry["shape"] for name, entry in recorded.items()}
    assert shapes["embed_tokens.weight"] == [4096, 64]  # the whole tensor's shape, not a rank's partition
    launched(halves)
    a, b = train_losses(run_dir_of(straight)), train_losses(run_dir_of(halves))
    assert sorted(b) == list(range(1, 9))
    for step in range(1, 9):
        assert b[step] == pytest.approx(a[step], abs=1e-5), step


@pytest.mark.parametrize("numel", [545_259_520, 525_336_576, 65_536_000, 16_777_217])
def test_sampled_positions_of_a_7b_embedding_stay_inside_it(numel):
    """Qwen2.5-7B's and Llama-3-8B's embeddings (and a 1.1B's): float32 linspace put the last index one past the end,
    and indexing there failed the first save of every 7B LoRA run on the GPU (a device-side assert)."""
    positions = sample_positions(numel)
    assert positions.dtype == torch.int64 and len(positions) == SAMPLES
    assert positions.min() == 0 and positions.max() == numel - 1
    assert bool((positions[1:] >= positions[:-1]).all())


def test_positions_of_tensors_saved_before_are_unchanged():
    """Where float32 linspace stayed inside the tensor, the indices (so the digests of saved checkpoints) are kept."""
    for numel in (1, 7, 64, 1000, 2**20 + 3, 2**24):
        before = torch.linspace(0, numel - 1, min(SAMPLES, numel)).long()
        assert torch.equal(sample_positions(numel), before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_tensor_on_the_gpu_samples_the_elements_it_does_on_the_cpu():
    """A checkpoint saved on the GPU is checked wherever the run resumes: the sampled elements cannot depend on the
    device, also past 2^24 elements, where float32 index arithmetic could round one way on each."""
    embedding = torch.nn.Embedding(128_000, 512, dtype=torch.bfloat16).requires_grad_(False)
    on_the_cpu = fingerprint(embedding)
    assert fingerprint(embedding.cuda()) == on_the_cpu
