"""`memtrain run` end to end on DeepSpeed's CPU accelerator with a real tiny Llama and real text."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from memtrain.commands.run import run_command
from memtrain.train.resolve import RunOptions
from memtrain.train.runtime.distributed import without_rank_variables
from memtrain.train.runtime.preflight import cpu_fp16_supported
from tests.conftest import read_records, train_losses

pytestmark = pytest.mark.slow


def clean_env(**extra: str) -> dict:
    """The environment for a child `memtrain run`: without the rank variables in-process runs set here."""
    env = without_rank_variables(os.environ)
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def run(path: Path, *overrides: str, **options) -> int:
    """`memtrain run` in this process (it reads MEMTRAIN_INJECT_OOM* afresh each time)."""
    return run_command(path, list(overrides), RunOptions(**options))


def run_in_child(path: Path, timeout_s: int = 900, **env: str) -> str:
    """`memtrain run` in a child process (two processes launch their own workers), one thread each; it must pass.
    Returns what it wrote to stderr."""
    result = subprocess.run(
        [sys.executable, "-m", "memtrain", "run", str(path)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=clean_env(OMP_NUM_THREADS="1", **env),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stderr


def run_dir_of(path: Path) -> Path:
    import yaml

    return Path(yaml.safe_load(path.read_text())["train"]["output_dir"])


def test_quickstart_recipe_validation_perplexity_falls(tmp_path):
    """The shipped quickstart itself (shortened): real Shakespeare, the builtin tokenizer, the tiny preset."""
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"
    run_dir = tmp_path / "quickstart"
    assert (
        run(
            recipe,
            "train.steps=60",
            "train.eval_every=20",
            "schedule.warmup_steps=10",
            f"train.output_dir={run_dir}",
            f"data.cache_dir={tmp_path / 'cache'}",
            save=False,
        )
        == 0
    )
    perplexities = [e["perplexity"] for e in read_records(run_dir, "eval")]
    assert len(perplexities) == 3
    assert perplexities[0] > perplexities[1] > perplexities[2]
    assert perplexities[2] < 0.8 * perplexities[0], perplexities


def test_training_lowers_the_loss_and_exports_a_model_that_generates(write_recipe):
    recipe = write_recipe("learn", {"train": {"steps": 30, "eval_every": 10}})
    assert run(recipe, profile_steps=2) == 0
    run_dir = run_dir_of(recipe)
    trace = json.loads((run_dir / "trace.json").read_text())  # --profile 2: a Chrome trace of two steps
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"forward", "backward", "optimizer_step"} <= names
    summary = (run_dir / "profile_summary.txt").read_text()  # and the table of where the time went
    assert "By host time" in summary and "aten::mm" in summary
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, 31))
    first, last = sum(losses[s] for s in (1, 2, 3)) / 3, sum(losses[s] for s in (28, 29, 30)) / 3
    assert last < first - 1.0, (first, last)
    evals = read_records(run_dir, "eval")
    assert [e["step"] for e in evals] == [10, 20, 30]
    assert evals[-1]["loss"] < evals[0]["loss"]
    assert evals[-1]["perplexity"] == pytest.approx(math.exp(evals[-1]["loss"]), rel=1e-6)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = run_dir / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    prompt = tokenizer("To be, or not", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 8
    assert isinstance(tokenizer.decode(out[0]), str)
    # the exported weights are the trained ones, not the initial ones
    assert any(name.endswith("embed_tokens.weight") for name, _ in model.named_parameters())
    ends = [r for r in read_records(run_dir, "run") if r.get("event") == "end"]
    assert ends[-1]["status"] == "done"


@pytest.mark.skipif(not cpu_fp16_supported(), reason="DeepSpeed's CPU accelerator has no fp16 on this CPU")
def test_fp16_records_the_loss_scale_and_skipped_steps(write_recipe):
    recipe = write_recipe(
        "fp16",
        {
            "precision": {"compute": "fp16", "loss_scale": {"initial_scale_power": 30, "hysteresis": 1}},
            "train": {"steps": 6, "eval_every": 100, "save_every": 100},
        },
    )
    assert run(recipe, save=False) == 0
    records = read_records(run_dir_of(recipe), "train")
    scales = [r["loss_scale"] for r in records]
    # 2**30 overflows fp16 gradients: the scaler halves it and skips those steps
    assert scales[0] < 2.0**30 and scales == sorted(scales, reverse=True)
    assert records[-1]["skipped_steps"] >= 1
    assert all(math.isfinite(r["loss"]) for r in records)


def test_resume_continues_exactly(write_recipe):
    straight = write_recipe("straight", {"train": {"steps": 12, "save_every": 6, "eval_every": 100}})
    assert run(straight) == 0
    halves = write_recipe("halves", {"train": {"steps": 12, "save_every": 6, "eval_every": 100}})
    assert run(halves, max_steps=6) == 0  # a requested stop: checkpoint, no export
    assert not (run_dir_of(halves) / "final").exists()
    first_half = train_losses(run_dir_of(halves))
    assert sorted(first_half) == list(range(1, 7))
    assert run(halves) == 0
    a, b = train_losses(run_dir_of(straight)), train_losses(run_dir_of(halves))
    assert sorted(b) == list(range(1, 13))
    for step in range(1, 13):
        assert b[step] == pytest.approx(a[step], abs=1e-5), step
    resumed = [r for r in read_records(run_dir_of(halves), "run") if r.get("event") == "resume"]
    assert resumed and resumed[0]["step"] == 6


def test_checkpoints_are_atomic_and_pruned(write_recipe):
    recipe = write_recipe("ckpt", {"train": {"steps": 9, "save_every": 3, "keep_last": 2, "eval_every": 100}})
    assert run(recipe) == 0
    root = run_dir_of(recipe) / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-000006", "step-000009"]
    # a save killed half-way leaves a .tmp- directory that resume ignores
    (root / ".tmp-step-000012").mkdir()
    from memtrain.train.state.checkpoint import latest_checkpoint

    assert latest_checkpoint(run_dir_of(recipe)).name == "step-000009"


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(write_recipe, tmp_path):
    recipe = write_recipe("term", {"train": {"steps": 400, "save_every": 1000, "eval_every": 1000}})
    proc = subprocess.Popen(
        [sys.executable, "-m", "memtrain", "run", str(recipe)],
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = run_dir_of(recipe) / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and '"train"' in metrics.read_text()):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 143, output  # 128 + SIGTERM, as shells and schedulers expect
    assert "Traceback" not in output
    ends = [r for r in read_records(run_dir_of(recipe), "run") if r.get("event") == "end"]
    assert ends[-1]["status"] == "interrupted"
    from memtrain.train.state.checkpoint import latest_checkpoint

    saved = latest_checkpoint(run_dir_of(recipe))
    assert saved is not None and int(saved.name.split("-")[1]) == ends[-1]["step"]


def test_lora_trains_only_adapters_and_exports_an_adapter(write_recipe):
    recipe = write_recipe(
        "lora",
        {
            "model": {
                "lora": {
                    "r": 4,
                    "alpha": 8,
                    "dropout": 0.0,
                    "target_modules": ["q_proj", "v_proj", "gate_proj", "down_proj"],
                }
            },
            "optimizer": {"lr": 3.0e-2},
            "train": {"steps": 20, "eval_every": 100},
        },
    )
    assert run(recipe) == 0
    final = run_dir_of(recipe) / "final"
    assert (final / "adapter_config.json").is_file()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from memtrain.model.config import model_config
    from memtrain.recipe.schema import Model

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(model_config(Model(preset="micro")))
    tuned = PeftModel.from_pretrained(base, final)
    lora_b = [p for n, p in tuned.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # B starts at zero; training moved it
    losses = train_losses(run_dir_of(recipe))
    first, last = sum(losses[s] for s in (1, 2, 3)) / 3, sum(losses[s] for s in (18, 19, 20)) / 3
    assert last < first - 0.05, (first, last)


def test_two_processes_match_one_process_with_twice_the_accumulation(write_recipe):
    common = {
        "offload": {"optimizer": "cpu"},
        "batch": {"global_batch": 8, "micro_batch": 2},
        "train": {"steps": 6, "eval_every": 100, "save_every": 100},
    }
    two = write_recipe("two", {**common, "hardware": {"gpus": 2}})
    one = write_recipe("one", {**common, "hardware": {"gpus": 1}})
    run_in_child(two)
    assert run(one) == 0
    a, b = train_losses(run_dir_of(one)), train_losses(run_dir_of(two))
    assert sorted(b) == list(range(1, 7))
    # the logged loss is the whole global batch's mean on either (it was rank 0's half)
    for step in range(1, 7):
        assert b[step] == pytest.approx(a[step], abs=1e-4), (step, a, b)
    # and the weights after 6 steps agree, so the evaluation losses agree
    ea = read_records(run_dir_of(one), "eval")[-1]["loss"]
    eb = read_records(run_dir_of(two), "eval")[-1]["loss"]
    assert eb == pytest.approx(ea, rel=1e-4)
    assert b[6] < b[1] and a[6] < a[1]


def _libaio_available() -> bool:
    return Path("/usr/include/libaio.h").exists()


@pytest.mark.skipif(
    not _libaio_available() and not os.environ.get("MEMTRAIN_REQUIRE_NVME"),
    reason="the NVMe tier needs libaio-dev (apt-get install libaio-dev); CI installs it",
)
def test_nvme_tier_swaps_under_the_given_path(write_recipe, tmp_path):
    """Parameters and optimizer states both go through NVMe swap files.

    DeepSpeed keeps parameters under 1 MiB in memory, so the model has 512-wide layers (1 MiB and up in
    fp32): with the micro preset nothing but optimizer states was swapped, and a 1.1B run on the GPU
    machine then stopped in its first step ("Not enough buffers 0 for swapping 1") — parameters kept
    for reuse in backward held every swap buffer. Checkpointing every layer, as the NVMe recipe does."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    model_dir = tmp_path / "llama-512"
    AutoModelForCausalLM.from_config(
        LlamaConfig(
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=8,
            vocab_size=4096,
            max_position_embeddings=256,
        )
    ).save_pretrained(model_dir)
    nvme = tmp_path / "nvme"
    recipe = write_recipe(
        "nvme",
        {
            "model": {"preset": None, "path": str(model_dir)},
            "hardware": {"nvme_path": str(nvme)},
            "offload": {"optimizer": "nvme", "params": "nvme"},
            "checkpointing": {"strategy": "every_layer"},
            "batch": {"global_batch": 4, "micro_batch": 2},
            "train": {"steps": 3, "eval_every": 100, "save_every": 100},
        },
    )
    assert run(recipe) == 0
    swapped = [p for p in nvme.rglob("*.swp") if p.is_file()]
    params = [p for p in swapped if "params" in p.parent.parent.name]
    optimizer = [p for p in swapped if "optimizer" in p.parts]
    # every linear weight of both layers (7 each) and the embedding and head are on disk
    assert len(params) >= 2 * 7 + 2, sorted(p.name for p in params)
    assert optimizer, "no optimizer swap files under the NVMe path"
    losses = train_losses(run_dir_of(recipe))
    assert sorted(losses) == [1, 2, 3] and all(math.isfinite(v) for v in losses.values())
    # the ZeRO-3 export holds every weight under the model's own names (not the training wrapper's)
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    final = run_dir_of(recipe) / "final"
    with safe_open(final / "model.safetensors", "pt") as exported:
        names = set(exported.keys())
    model, info = AutoModelForCausalLM.from_pretrained(final, output_loading_info=True)
    assert names == set(model.state_dict()) and not info["missing_keys"], sorted(names)[:3]


def traced_samples(trace: Path) -> dict[int, list[int]]:
    """Sample ids whose gradients went into each applied step (MEMTRAIN_TRACE_SAMPLES)."""
    per_step: dict[int, list[int]] = {}
    for line in trace.read_text().splitlines():
        record = json.loads(line)
        per_step.setdefault(record["step"], []).extend(record["indices"])
    return per_step


def clean_and_faulty(write_recipe, tmp_path, monkeypatch, extra: dict, inject_env: str, spec: str):
    """Run a recipe twice, the second time with injected OOMs: (samples, run_dir) of each run."""
    results = []
    for name, points in (("clean", ""), ("faulty", spec)):
        recipe = write_recipe(name, extra)
        trace = tmp_path / f"{name}.samples.jsonl"
        monkeypatch.setenv("MEMTRAIN_TRACE_SAMPLES", str(trace))
        monkeypatch.setenv(inject_env, points)
        assert run(recipe) == 0
        results.append((traced_samples(trace), run_dir_of(recipe)))
    return results


def assert_same_samples_and_losses(clean, faulty, steps: int, global_batch: int) -> None:
    (a, dir_a), (b, dir_b) = clean, faulty
    assert sorted(a) == sorted(b) == list(range(steps))
    for step in a:  # every sample once, none lost, none twice
        assert sorted(b[step]) == sorted(a[step]) and len(b[step]) == global_batch, step
    assert [r["step"] for r in read_records(dir_b, "train")] == list(range(1, steps + 1))
    la, lb = train_losses(dir_a), train_losses(dir_b)
    for step in la:
        assert lb[step] == pytest.approx(la[step], rel=1e-4, abs=1e-4), step


def test_injected_ooms_lose_no_sample_and_keep_the_math(write_recipe, tmp_path, monkeypatch):
    extra = {
        "batch": {"global_batch": 8, "micro_batch": 4, "policy": "adaptive"},
        "train": {"steps": 6, "eval_every": 100, "save_every": 100},
    }
    clean, faulty = clean_and_faulty(write_recipe, tmp_path, monkeypatch, extra, "MEMTRAIN_INJECT_OOM", "1:0,3:1")
    assert_same_samples_and_losses(clean, faulty, steps=6, global_batch=8)
    assert [o["step"] for o in read_records(faulty[1], "oom")] == [1, 3]


@pytest.mark.parametrize("strategy", [{"strategy": "every_layer"}, {"strategy": "every_n_layers", "every_n_layers": 2}])
def test_an_oom_inside_a_checkpointed_layer_is_retried_exactly(write_recipe, tmp_path, monkeypatch, strategy):
    """The OOM comes from inside a recomputed decoder layer's forward, so a checkpointed region is left
    open when it unwinds (on torch < 2.13 with its saved-tensor hooks still installed); the retry
    must neither save into it nor keep its tensors: same samples and losses as a clean run."""
    extra = {
        "batch": {"global_batch": 8, "micro_batch": 4, "policy": "adaptive"},
        "checkpointing": strategy,
        "train": {"steps": 4, "eval_every": 100, "save_every": 100},
    }
    clean, faulty = clean_and_faulty(
        write_recipe, tmp_path, monkeypatch, extra, "MEMTRAIN_INJECT_OOM", "1:0@layer0,2:1@layer1"
    )
    assert_same_samples_and_losses(clean, faulty, steps=4, global_batch=8)
    assert [o["step"] for o in read_records(faulty[1], "oom")] == [1, 2]


@pytest.mark.parametrize("stage", [2, 3])
def test_an_oom_in_backward_loses_no_sample_and_keeps_the_math(write_recipe, tmp_path, monkeypatch, stage):
    """ZeRO-3 drops the step's partial gradients in place; ZeRO-2 cannot, so it saves the last
    completed step and restarts from it with the smaller micro-batch."""
    extra = {
        "batch": {"global_batch": 8, "micro_batch": 4, "policy": "adaptive"},
        "offload": {"zero_stage": stage},
        "train": {"steps": 5, "eval_every": 100, "save_every": 100},
    }
    clean, faulty = clean_and_faulty(write_recipe, tmp_path, monkeypatch, extra, "MEMTRAIN_INJECT_OOM_BACKWARD", "2:1")
    assert_same_samples_and_losses(clean, faulty, steps=5, global_batch=8)
    run_dir = faulty[1]
    assert [(o["step"], o["in_backward"]) for o in read_records(run_dir, "oom")] == [(2, True)]
    ends = [r["status"] for r in read_records(run_dir, "run") if r.get("event") == "end"]
    assert ends == (["restart", "done"] if stage == 2 else ["done"])
    assert read_records(run_dir, "train")[-1]["micro_batch"] < 4


def test_ranks_recover_together_from_an_oom_on_one_rank(write_recipe, tmp_path, monkeypatch):
    """Two processes; only rank 1 runs out of memory. Both skip that backward, shrink alike and
    retry, so their gradient reductions stay paired: same samples and losses as a clean run."""
    extra = {
        "hardware": {"gpus": 2},
        "batch": {"global_batch": 8, "micro_batch": 4, "policy": "adaptive"},
        "train": {"steps": 4, "eval_every": 100, "save_every": 100},
    }
    monkeypatch.setenv("MEMTRAIN_INJECT_RANK", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    clean, faulty = clean_and_faulty(write_recipe, tmp_path, monkeypatch, extra, "MEMTRAIN_INJECT_OOM", "1:0")
    (a, _), (b, run_dir) = clean, faulty
    for step in range(4):
        assert sorted(b[step]) == sorted(a[step]) and len(b[step]) == 8, step
    assert [o["step"] for o in read_records(run_dir, "oom")] == [1]
    la, lb = train_losses(clean[1]), train_losses(run_dir)
    assert sorted(lb) == [1, 2, 3, 4]
    for step in la:
        assert lb[step] == pytest.approx(la[step], rel=1e-4, abs=1e-4), step
    assert read_records(run_dir, "train")[-1]["micro_batch"] < 4
    # the start-up record of a two-process run begins at the command, as one process's does (it began at the
    # worker's own start, leaving out the launcher's checks, data and plan and torchrun's start)
    startup = read_records(run_dir, "startup")[0]
    assert list(startup["phases_s"])[:6] == ["launch", "load_recipe", "checks", "data", "plan", "workers"]
    assert {"process", "model", "deepspeed_init", "first_step"} <= set(startup["phases_s"])
    assert sum(startup["phases_s"].values()) == pytest.approx(startup["first_step_s"], abs=0.02)


@pytest.mark.parametrize("stage", [2, 3])
def test_an_oom_in_one_ranks_backward_restarts_every_process_from_the_last_checkpoint(
    write_recipe, tmp_path, monkeypatch, capfd, stage
):
    """Two processes; rank 1 alone runs out of memory in the backward of step 3, where rank 0 waits for it in a
    gradient reduction. Under ZeRO-2 it hung there until gloo's timeout (10 minutes, measured); under ZeRO-3 rank 1
    retried in place while rank 0 still waited. Now rank 1 leaves a note and ends; every process starts
    again from the checkpoint of step 2 at a smaller micro-batch (the same on both ranks), and the run trains the
    samples and losses of a clean run, with one line said and no traceback."""
    from memtrain.train.state.restart_note import NOTE_FILE

    extra = {
        "hardware": {"gpus": 2},
        "batch": {"global_batch": 8, "micro_batch": 4, "policy": "adaptive"},
        "offload": {"zero_stage": stage},
        "train": {"steps": 4, "eval_every": 100, "save_every": 2},
    }
    monkeypatch.setenv("MEMTRAIN_INJECT_RANK", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    clean, faulty = clean_and_faulty(
        write_recipe, tmp_path, monkeypatch, extra, "MEMTRAIN_INJECT_OOM_BACKWARD", "2:0:mb>=4"
    )
    said = " ".join(capfd.readouterr().err.split())
    assert_same_samples_and_losses(clean, faulty, steps=4, global_batch=8)
    run_dir = faulty[1]
    assert [(o["step"], o["rank"], o["in_backward"], o["restarted_from"]) for o in read_records(run_dir, "oom")] == [
        (2, 1, True, 2)
    ]
    assert [r["micro_batch"] for r in read_records(run_dir, "train")] == [4, 4, 2, 2]
    line = (
        "out of memory in backward at step 3 on rank 1 (micro-batch 4); the other processes wait for it in "
        "their gradient reduction, so it cannot be retried in place: every process starts again from step 2, "
        "its last checkpoint, at micro-batch 2"
    )
    assert said.count(line) == 1, said[-3000:]
    assert (
        said.count(
            "· starting at micro-batch 2: rank 1 ran out of memory in the backward of step 3 at micro-batch "
            "4 (oom-restart.json in the run directory, until the next checkpoint)"
        )
        == 1
    ), said[-3000:]
    assert "Traceback" not in said and "exitcode" not in said, said[-3000:]
    assert not (run_dir / NOTE_FILE).exists()  # spent by the checkpoint of step 4
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    resumed = next(i for i, r in enumerate(records) if r["kind"] == "run" and r.get("event") == "resume")
    assert records[resumed + 1]["kind"] == "oom" and records[resumed + 2]["kind"] == "batch"  # after the resume record


def test_an_oom_in_one_ranks_backward_at_the_smallest_size_ends_both_ranks_with_one_line(
    write_recipe, monkeypatch, capfd
):
    """Rank 1 stopped with its problem said (exit 2) and rank 0, whose collective broke, added a gloo
    traceback and no end record, so `report` said "running or killed". Rank 0 now ends quietly with the same code and
    records how the run ended."""
    recipe = write_recipe(
        "smallest-two",
        {
            "hardware": {"gpus": 2},
            "batch": {"global_batch": 4, "micro_batch": 1},
            "train": {"steps": 4, "eval_every": 100, "save_every": 1},
        },
    )
    monkeypatch.setenv("MEMTRAIN_INJECT_OOM_BACKWARD", "2:0")
    monkeypatch.setenv("MEMTRAIN_INJECT_RANK", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert run(recipe) == 2
    said = " ".join(capfd.readouterr().err.split())
    assert said.count("out of memory in backward at step 3 on rank 1 (micro-batch 1)") == 1, said[-3000:]
    assert "micro-batch 1 is the smallest this run may use" in said
    assert "Traceback" not in said and "Connection closed" not in said and "exitcode" not in said, said[-3000:]
    ends = [r["status"] for r in read_records(run_dir_of(recipe), "run") if r.get("event") == "end"]
    assert ends == ["ended_on_another_rank"]


@pytest.mark.parametrize("gpus", [1, 2])
def test_max_steps_stops_at_the_same_step_through_an_oom_restart(write_recipe, monkeypatch, gpus):
    """Each attempt counted --max-steps from where it resumed, so a run asked for 3 steps whose
    backward ran out of memory in step 3 stopped at step 5, saying "as asked". One process saves the step before
    and starts again there; two start again from the last checkpoint (step 2)."""
    from memtrain.train.state.checkpoint import complete_checkpoints

    recipe = write_recipe(
        f"max-steps-{gpus}",
        {
            "hardware": {"gpus": gpus},
            "batch": {"global_batch": 8, "micro_batch": 4 // gpus, "policy": "adaptive"},
            "train": {"steps": 8, "eval_every": 100, "save_every": 2},
        },
    )
    monkeypatch.setenv("MEMTRAIN_INJECT_OOM_BACKWARD", f"2:0:mb>={4 // gpus}")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    if gpus == 2:
        monkeypatch.setenv("MEMTRAIN_INJECT_RANK", "1")
    assert run(recipe, max_steps=3) == 0
    run_dir = run_dir_of(recipe)
    assert [r["step"] for r in read_records(run_dir, "oom")] == [2]
    assert max(r["step"] for r in read_records(run_dir, "train")) == 3
    assert [p.name for p in complete_checkpoints(run_dir)][-1] == "step-000003"


def test_repeated_ooms_at_the_smallest_size_stop_with_a_checkpoint_and_advice(write_recipe, monkeypatch):
    recipe = write_recipe(
        "giveup",
        {
            "batch": {"global_batch": 8, "micro_batch": 4, "policy": "adaptive"},
            "train": {"steps": 5, "eval_every": 100, "save_every": 100},
        },
    )
    monkeypatch.setenv("MEMTRAIN_INJECT_OOM", "2:0*20")  # step 3 never fits, at any size
    from typer.testing import CliRunner

    from memtrain.cli import app
    from memtrain.train.state.checkpoint import latest_checkpoint

    result = CliRunner().invoke(app, ["run", str(recipe)])
    assert result.exit_code == 2, result.output
    assert "memtrain plan" in result.output and "Traceback" not in result.output
    run_dir = run_dir_of(recipe)
    assert latest_checkpoint(run_dir).name == "step-000002"  # the last completed step is kept
    ends = [r for r in read_records(run_dir, "run") if r.get("event") == "end"]
    assert ends[-1]["status"] == "gave_up"
    sizes = [o["micro_batch"] for o in read_records(run_dir, "oom")]
    assert sizes[:2] == [4, 2] and sizes[-1] == 1


def test_a_layer_injection_point_beyond_the_model_is_refused_before_the_run_dir_exists(write_recipe, monkeypatch):
    recipe = write_recipe("layer-range")
    monkeypatch.setenv("MEMTRAIN_INJECT_OOM", "1:0@layer4")  # the micro preset has layers 0 and 1
    from typer.testing import CliRunner

    from memtrain.cli import app

    result = CliRunner().invoke(app, ["run", str(recipe)])
    assert result.exit_code == 2, result.output
    assert "@layer0 to @layer1" in result.output and "Traceback" not in result.output
    assert not run_dir_of(recipe).exists()


def test_a_host_too_small_for_the_offloaded_states_is_refused_before_any_work(write_recipe):
    recipe = write_recipe(
        "tinyhost",
        {
            "model": {"preset": "llama2-7b"},
            "offload": {"optimizer": "cpu", "params": "cpu"},
            "hardware": {"host_memory": "32GiB"},
            "precision": {"compute": "bf16"},
        },
    )
    from typer.testing import CliRunner

    from memtrain.cli import app

    result = CliRunner().invoke(app, ["run", str(recipe)])
    assert result.exit_code == 2, result.output
    assert "host memory" in result.output and "32.0 GiB" in result.output and "Traceback" not in result.output
    # the hint is the cheapest change `memtrain plan --fit` finds for 32 GiB: the step in backward (14.9 GiB planned
    # while training, 27.5 while a checkpoint save copies the bf16 weights to the host)
    assert "the cheapest change that fits: optimizer.step_in_backward=true" in " ".join(result.output.split())
    assert not run_dir_of(recipe).exists()


def test_checkpointing_auto_trains_with_the_layers_the_planner_chose(write_recipe):
    """A card sized between the plans with 0 and 1 recomputed layers: auto recomputes exactly one,
    and the run records (and trains with) that concrete strategy."""
    from memtrain.plan.planner import plan_recipe
    from memtrain.recipe.load import load_recipe

    def required_high(layers: int) -> int:
        path = write_recipe(f"n{layers}", {"checkpointing": {"strategy": "first_n_layers", "first_n_layers": layers}})
        plan = plan_recipe(load_recipe(path).recipe)
        return plan.peak_reserved_high_bytes + plan.cuda_context

    card_bytes = (required_high(0) + required_high(1)) // 2
    recipe = write_recipe(
        "auto",
        {
            "checkpointing": {"strategy": "auto"},
            "hardware": {"gpu": str(card_bytes)},
            "train": {"steps": 3, "eval_every": 100, "save_every": 100},
        },
    )
    assert run(recipe, save=False) == 0
    recorded = json.loads((run_dir_of(recipe) / "recipe.json").read_text())["checkpointing"]
    assert (recorded["strategy"], recorded["first_n_layers"]) == ("first_n_layers", 1)
    assert len(train_losses(run_dir_of(recipe))) == 3


@pytest.mark.skipif(cpu_fp16_supported(), reason="this CPU computes in fp16")
def test_fp16_on_a_cpu_without_it_is_refused_with_the_key(write_recipe):
    recipe = write_recipe("fp16-refused", {"precision": {"compute": "fp16"}})
    from typer.testing import CliRunner

    from memtrain.cli import app

    result = CliRunner().invoke(app, ["run", str(recipe)])
    assert result.exit_code == 2, result.output
    assert "precision.compute" in result.output and "bf16" in result.output and "Traceback" not in result.output
    assert not run_dir_of(recipe).exists()


def test_bad_input_fails_before_any_work_with_nothing_written(write_recipe, tmp_path):
    data = tmp_path / "broken.jsonl"
    data.write_text('{"text": "fine"}\n{"prompt": "no text field"}\n')
    recipe = write_recipe("bad", {"data": {"train": str(data), "validation": None}})
    from typer.testing import CliRunner

    from memtrain.cli import app

    result = CliRunner().invoke(app, ["run", str(recipe)])
    assert result.exit_code == 2
    assert "line 2" in result.output and "text" in result.output
    assert "Traceback" not in result.output
    assert not run_dir_of(recipe).exists()


def test_two_processes_under_zero3_evaluate_an_uneven_split_as_one_process(write_recipe):
    """Three validation batches of one sample over two ranks: one rank's share makes two micro-batches, the other's
    one. ZeRO-3 gathers the parameters in every forward (max_live_parameters 0: none stay gathered, as a 7B's do
    not), so the second rank runs its first again uncounted; the run used to wait in that gather for ever. Its
    validation losses are one process's."""
    common = {
        "offload": {"zero_stage": 3, "max_live_parameters": 0},
        "batch": {"global_batch": 2, "micro_batch": 1},
        "train": {"steps": 2, "eval_every": 1, "eval_batches": 3, "save_every": 100},
    }
    two = write_recipe("two-zero3", {**common, "hardware": {"gpus": 2}})
    one = write_recipe("one-zero3", {**common, "hardware": {"gpus": 1}})
    run_in_child(two, timeout_s=300)
    assert run(one) == 0
    a, b = (read_records(run_dir_of(r), "eval") for r in (one, two))
    assert [e["step"] for e in b] == [e["step"] for e in a] == [1, 2]
    for ea, eb in zip(a, b, strict=True):
        assert eb["loss"] == pytest.approx(ea["loss"], rel=1e-5)
