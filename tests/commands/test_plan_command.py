"""`memtrain plan`: exit codes, --json shape, advice, and --fit writing a recipe that fits."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

from memtrain.cli import app
from memtrain.commands.plan import plan_command
from memtrain.errors import RecipeError
from memtrain.plan.advice import advise
from memtrain.plan.planner import TERMS, plan_recipe
from memtrain.recipe.load import load_recipe

GiB = 1024**3
RECIPE = """\
# a tiny model on a card of a chosen size
model:
  preset: tiny
data:
  train: builtin:shakespeare
  seq_len: 512
hardware:
  gpus: 1
  gpu: {gpu}
checkpointing:
  strategy: none
precision:
  compute: bf16
  chunked_loss: false
batch:
  global_batch: 16
  micro_batch: 16
train:
  steps: 10
"""


def write(tmp_path: Path, gpu: str = "24GiB", name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(RECIPE.format(gpu=gpu))
    return path


def run(path: Path, *overrides: str, **options) -> tuple[int, str]:
    console = Console(file=io.StringIO(), width=160, color_system=None)
    options = {"gpu": None, "fit": False, "output": None, "as_json": False, **options}
    code = plan_command(path, list(overrides), console=console, **options)
    return code, console.file.getvalue()


def test_fitting_recipe_exits_0_and_prints_the_breakdown_and_verdict(tmp_path):
    code, text = run(write(tmp_path))
    assert code == 0
    for label in (
        "model_params",
        "gradients",
        "optimizer_states",
        "activation_memory",
        "peak reserved",
        "host",
        "NVMe",
    ):
        assert label in text
    assert "fits with" in text and "GiB to spare" in text


def test_recipe_that_misses_exits_1_and_names_the_cheapest_change(tmp_path):
    path = write(tmp_path, gpu="1GiB")
    code, text = run(path)
    assert code == 1
    assert "misses by" in text and "cheapest changes that fit" in text
    advice = advise(load_recipe(path))
    assert advice and all(a.plan.fits for a in advice)
    costs = [a.speed_cost for a in advice]
    assert costs == sorted(costs)
    # the cheapest advice, applied as overrides, gives the plan it promised
    applied = plan_recipe(load_recipe(path, advice[0].overrides).recipe)
    assert applied.fits and applied.peak_reserved_bytes == advice[0].peak_reserved_bytes


def test_json_has_terms_phases_host_nvme_and_verdict(tmp_path):
    code, text = run(write(tmp_path, gpu="1GiB"), as_json=True)
    data = json.loads(text)
    assert code == 1
    plan = data["plan"]
    assert set(plan["terms"]) == set(TERMS)
    assert set(plan["phases"]) == {"init", "forward_end", "backward_start", "optimizer_step"}
    assert plan["peak_allocated_bytes"] == max(plan["phases"].values())
    assert plan["fits"] is False and plan["headroom_bytes"] < 0 and plan["gpu_capacity_bytes"] == GiB
    for key in ("host_bytes", "host_breakdown", "nvme_bytes", "peak_reserved_bytes"):
        assert key in plan
    assert data["verdict"].startswith("misses by")
    assert data["advice"] and {"overrides", "peak_reserved_bytes", "speed_cost", "reason", "tight"} <= set(
        data["advice"][0]
    )


def test_gpu_option_asks_about_another_card(tmp_path):
    path = write(tmp_path, gpu="1GiB")
    assert run(path, gpu="rtx4090")[0] == 0
    small = json.loads(run(path, gpu="1GiB", as_json=True)[1])["plan"]
    big = json.loads(run(path, gpu="rtx4090", as_json=True)[1])["plan"]
    assert big["gpu_capacity_bytes"] == 24 * GiB and small["peak_reserved_bytes"] == big["peak_reserved_bytes"]


def test_fit_writes_a_recipe_that_validates_and_is_predicted_to_fit(tmp_path):
    path = write(tmp_path, gpu="1GiB")
    output = tmp_path / "out" / "fitted.yaml"
    code, text = run(path, fit=True, output=output)
    assert code == 0 and output.is_file()
    fitted = load_recipe(output)
    assert fitted.recipe.hardware.gpu == "1GiB"
    assert plan_recipe(fitted.recipe).fits
    assert "# a tiny model" not in output.read_text()  # the header says where it came from instead
    assert output.read_text().startswith("# Fitted by `memtrain plan --fit`")
    assert not list(output.parent.glob("*.tmp"))


def test_fit_keeps_command_line_overrides_and_extends(tmp_path):
    base = write(tmp_path, gpu="1GiB", name="base.yaml")
    child = tmp_path / "child.yaml"
    child.write_text("extends: base.yaml\nbatch:\n  global_batch: 8\n  micro_batch: 8\n")
    output = tmp_path / "elsewhere" / "fitted.yaml"
    code, _ = run(child, "train.steps=7", fit=True, output=output)
    assert code == 0
    fitted = load_recipe(output)
    assert fitted.recipe.train.steps == 7 and fitted.recipe.batch.global_batch == 8
    assert plan_recipe(fitted.recipe).fits
    assert Path(base).exists()


def test_bad_recipes_are_recipe_errors_not_tracebacks(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(RECIPE.format(gpu="24GiB").replace("seq_len: 512", "seq_len: 512\n  seq_lenn: 3"))
    with pytest.raises(RecipeError, match="seq_lenn"):
        run(path)
    with pytest.raises(RecipeError):
        run(write(tmp_path), "batch.micro_batch=3")  # does not divide the global batch
    with pytest.raises(RecipeError, match="--fit"):
        run(write(tmp_path), output=tmp_path / "x.yaml")


def test_cli_exit_codes(tmp_path):
    runner = CliRunner()
    assert runner.invoke(app, ["plan", str(write(tmp_path))]).exit_code == 0
    assert runner.invoke(app, ["plan", str(write(tmp_path, gpu="1GiB", name="small.yaml"))]).exit_code == 1
    bad = runner.invoke(app, ["plan", str(write(tmp_path)), "hardware.gpu=potato"])
    assert bad.exit_code == 2
    as_json = runner.invoke(app, ["plan", str(write(tmp_path, gpu="1GiB", name="j.yaml")), "--json"])
    assert as_json.exit_code == 1 and json.loads(as_json.stdout)["advice"]  # long lines are not wrapped


def test_spare_memory_is_offered_as_a_larger_micro_batch(tmp_path, capsys):
    from memtrain.commands.plan import larger_micro_batch
    from memtrain.plan.planner import plan_recipe as plan_of
    from memtrain.recipe.load import load_recipe_text as load_text

    loaded = load_text("""
model: {preset: tiny}
data: {train: "builtin:shakespeare", seq_len: 64}
batch: {global_batch: 16, micro_batch: 2}
train: {steps: 10}
""")
    plan = plan_of(loaded.recipe)
    faster = larger_micro_batch(loaded, plan, gpu=None, exact_pinned=True)
    assert faster is not None and faster.micro_batch == 16 and faster.fits and not faster.tight
    assert faster.peak_reserved_bytes > plan.peak_reserved_bytes
    auto = load_text("""
model: {preset: tiny}
data: {train: "builtin:shakespeare", seq_len: 64}
batch: {global_batch: 16, micro_batch: auto}
train: {steps: 10}
""")
    assert (
        larger_micro_batch(auto, plan_of(auto.recipe), gpu=None, exact_pinned=True) is None
    )  # auto already takes the largest


def test_spare_memory_is_offered_as_fewer_recomputed_layers():
    from memtrain.commands.plan import fewer_recomputed_layers
    from memtrain.plan.planner import plan_recipe as plan_of
    from memtrain.recipe.load import load_recipe_text as load_text

    text = """
model: {preset: tiny}
data: {train: "builtin:shakespeare", seq_len: 1024}
hardware: {gpu: %s}
checkpointing: {strategy: %s}
batch: {global_batch: 16, micro_batch: 8}
train: {steps: 10}
"""
    every = load_text(text % ("1.0GiB", "every_layer"))  # between the plans with 1 and 2 layers recomputed
    plan = plan_of(every.recipe)
    assert plan.recomputed_layers == 4 and plan.fits
    fewer = fewer_recomputed_layers(every, plan, gpu=None, exact_pinned=True)
    assert fewer is not None and fewer.recomputed_layers == 2 and fewer.fits and not fewer.tight
    assert fewer.micro_batch == plan.micro_batch and fewer.peak_reserved_bytes > plan.peak_reserved_bytes
    roomy = load_text(text % ("24GiB", "every_n_layers"))
    assert fewer_recomputed_layers(roomy, plan_of(roomy.recipe), gpu=None, exact_pinned=True).recomputed_layers == 0
    assert (
        fewer_recomputed_layers(
            load_text(text % ("24GiB", "none")),
            plan_of(load_text(text % ("24GiB", "none")).recipe),
            gpu=None,
            exact_pinned=True,
        )
        is None
    )


def test_the_plan_says_what_checkpointing_auto_resolved_to(tmp_path):
    from typer.testing import CliRunner

    from memtrain.cli import app

    result = CliRunner().invoke(app, ["plan", str(write(tmp_path)), "checkpointing.strategy=auto", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)["plan"]
    assert plan["checkpointing"] == f"first_n_layers={plan['recomputed_layers']}"
    table = CliRunner().invoke(app, ["plan", str(write(tmp_path)), "checkpointing.strategy=auto"])
    words = " ".join(table.output.split())  # the title wraps to the table's width
    assert f"checkpointing first_n_layers={plan['recomputed_layers']}" in words


def test_lora_recipe_that_lean_dropout_makes_fit_is_advised_it_first():
    """A card between the recipe's peak with PEFT's dropout and with lean dropout: the cheapest change is lean."""
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "llama2-7b-lora-24gb.yaml"
    base = ["checkpointing.strategy=none", "batch.micro_batch=1", "data.seq_len=512"]
    peft = plan_recipe(load_recipe(recipe, base + ["model.lora.lean_dropout=false"]).recipe)
    lean = plan_recipe(load_recipe(recipe, base + ["model.lora.lean_dropout=true"]).recipe)
    assert lean.peak_reserved_bytes < peft.peak_reserved_bytes
    card_gib = (lean.peak_reserved_bytes + peft.peak_reserved_bytes) / 2 / GiB + 0.6  # + the CUDA context
    loaded = load_recipe(recipe, base + [f"hardware.gpu={card_gib:.2f}GiB"])
    assert not plan_recipe(loaded.recipe).fits
    advice = advise(loaded)
    assert advice[0].overrides == ["model.lora.lean_dropout=true"] and advice[0].plan.fits


def test_zero3_recipe_just_over_the_card_is_advised_fewer_live_parameters_not_a_smaller_micro_batch():
    """3B ZeRO-3 with parameters on the CPU at micro-batch 8 on a card 0.3 GiB too small: keeping fewer
    gathered parameters costs ~4 %; halving the micro-batch re-gathers every parameter twice as often."""
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "openllama-3b-full-offload-24gb.yaml"
    base = ["batch.micro_batch=8"]
    needs = plan_recipe(load_recipe(recipe, base).recipe).gpu_required_bytes
    loaded = load_recipe(recipe, base + [f"hardware.gpu={(needs - 0.3 * GiB) / GiB:.2f}GiB"])
    assert not plan_recipe(loaded.recipe).fits
    advice = advise(loaded)
    assert advice[0].overrides == ["offload.max_live_parameters=300000000"] and advice[0].plan.fits
    halved = next(a for a in advice if a.overrides == ["batch.micro_batch=4"])
    assert halved.speed_cost == 0.5 > advice[0].speed_cost


def test_compiled_layers_are_offered_only_where_they_were_measured_faster(tmp_path):
    lora = ["model.lora.r=8", "train.compile=false"]
    code, text = run(write(tmp_path), *lora)  # LoRA of a Llama, compile turned off: what auto compiles
    assert code == 0 and "faster: train.compile=true" in text
    _, as_json = run(write(tmp_path), *lora, as_json=True)
    assert json.loads(as_json)["compile_layers"] is True
    _, auto = run(write(tmp_path), "model.lora.r=8")  # auto compiles it already
    assert "train.compile=true fuses" not in auto
    _, full = run(write(tmp_path), "train.compile=false")  # a full fine-tune: never measured compiled
    assert "train.compile" not in full
    _, lean = run(write(tmp_path), *lora, "model.lora.lean_dropout=true")  # measured slower compiled
    assert "train.compile" not in lean
    # ZeRO-3 (parameters offloaded) cannot compile its layers: not offered
    _, zero3 = run(write(tmp_path), *lora, "offload.optimizer=cpu", "offload.params=cpu")
    assert "train.compile" not in zero3


def test_lean_dropout_is_not_advised_with_compiled_layers():
    from memtrain.plan.advice import _lora_dropout_options
    from memtrain.recipe.load import load_recipe_text

    text = """
model: {preset: tiny, lora: {r: 4, dropout: 0.1}}
data: {train: "builtin:shakespeare", seq_len: 64}
train: {steps: 10, compile: %s}
"""
    eager, compiled = (load_recipe_text(text % flag).recipe for flag in ("false", "true"))
    assert any("model.lora.lean_dropout=true" in o.overrides for o in _lora_dropout_options(eager))
    assert all("model.lora.lean_dropout=true" not in o.overrides for o in _lora_dropout_options(compiled))


def test_data_option_reports_tokens_targets_and_padding_per_step(tmp_path):
    """`plan --data` reads the data once (cached) and says what a step trains on; with --no-data the JSON has no
    data key and the plan reads no data."""
    recipe = tmp_path / "chat.yaml"
    recipe.write_text(f"""
model: {{preset: micro, tokenizer: "builtin:shakespeare"}}
data:
  train: [{{path: "builtin:chat", type: chat}}]
  seq_len: 64
  template: chatml
  add_special_tokens: true
  cache_dir: {tmp_path / "cache"}
batch: {{global_batch: 8, micro_batch: 4}}
train: {{steps: 4}}
""")
    plain = CliRunner().invoke(app, ["plan", str(recipe), "--json", "--no-data"])
    assert plain.exit_code == 0 and "data" not in json.loads(plain.stdout)
    assert not (tmp_path / "cache").exists()
    result = CliRunner().invoke(app, ["plan", str(recipe), "--json", "--data"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)["data"]
    # the attention backward is priced for the sequences packed rows hold: assumed without the data (4 rows of one
    # 256-token sample at most), the densest row's count with it (rows of 64 tokens hold several short chats)
    assumed, counted = json.loads(plain.stdout)["plan"], json.loads(result.stdout)["plan"]
    assert (assumed["packed_sequences"], assumed["packed_sequences_counted"]) == (4, False)
    assert counted["packed_sequences_counted"] and counted["packed_sequences"] % 4 == 0
    assert counted["packed_sequences"] > 4 and counted["peak_allocated_bytes"] >= assumed["peak_allocated_bytes"]
    # chatml closes every turn with <|im_end|>: no warning of it; builtin:chat repeats some questions, so its tail held
    # out for validation holds prompts training also holds, and that is said
    [trained_on] = json.loads(result.stdout)["data_warnings"]
    assert "held-out prompts also occur in the training data" in trained_on
    train = data["train"]
    assert data["rows_per_step"] == 8 and data["token_slots_per_step"] == 8 * 64
    assert data["tokens_per_step"] == round(8 * train["tokens"] / train["rows"])
    assert 0 < data["target_tokens_per_step"] < data["tokens_per_step"] <= 8 * 64
    assert data["padding_share"] == pytest.approx(1 - train["tokens"] / (train["rows"] * 64))
    assert data["length_bucketing"] is False
    # packing off with sdpa: one conversation per row, bucketed by length, each micro-batch of 4 cut to its longest row
    result = CliRunner().invoke(
        app, ["plan", str(recipe), "--json", "--data", "data.packing=false", "model.attn_implementation=sdpa"]
    )
    assert result.exit_code == 0, result.output
    unpacked = json.loads(result.stdout)["data"]
    rows_share = 1 - unpacked["train"]["tokens"] / (unpacked["train"]["rows"] * 64)  # were every row seq_len wide
    assert unpacked["length_bucketing"] is True and unpacked["padding_share"] < rows_share - 0.3
    assert unpacked["token_slots_per_step"] < 8 * 64
    # attention auto on the recipe's GPU is varlen: the step's 8 conversations are laid end to end into packed
    # micro-batches of 4 x 64, whole rows computed (one micro-batch a step where they fit 4 rows, two where not)
    result = CliRunner().invoke(app, ["plan", str(recipe), "--json", "--data", "data.packing=false"])
    laid = json.loads(result.stdout)["data"]
    assert laid["laid_out_packed"] is True and laid["length_bucketing"] is False
    assert unpacked["laid_out_packed"] is False and data["laid_out_packed"] is False
    assert 4 * 64 <= laid["token_slots_per_step"] <= 8 * 64
    assert laid["padding_share"] == pytest.approx(1 - laid["tokens_per_step"] / laid["token_slots_per_step"], abs=0.02)


def test_data_option_gives_every_column_over_the_same_steps(tmp_path):
    """With length bucketing the padding share was of the priced steps, the tokens of all rows, so
    1 - tokens / slots disagreed with the padding column (15.6 % shown, 21.4 % implied). 13 conversations of
    growing length, 8 rows a step: one step is priced, 5 rows are left over."""
    lines = [
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "Say it."},
                    {"role": "assistant", "content": "word " * (1 + 4 * i)},
                ]
            }
        )
        for i in range(14)
    ]
    (tmp_path / "chat.jsonl").write_text("\n".join(lines) + "\n")
    recipe = tmp_path / "chat.yaml"
    recipe.write_text(f"""
model: {{preset: micro, tokenizer: "builtin:shakespeare"}}
data:
  train: [{{path: {tmp_path / "chat.jsonl"}, type: chat}}]
  seq_len: 128
  template: chatml
  add_special_tokens: true
  packing: false
  cache_dir: {tmp_path / "cache"}
batch: {{global_batch: 8, micro_batch: 2}}
train: {{steps: 4}}
""")
    result = CliRunner().invoke(app, ["plan", str(recipe), "--json", "--data"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)["data"]
    # unpacked chat on the recipe's CUDA card: varlen, so the step's rows are laid out packed (not bucketed)
    assert data["laid_out_packed"] is True and data["length_bucketing"] is False and data["train"]["rows"] == 13
    implied = 1 - data["tokens_per_step"] / data["token_slots_per_step"]
    assert data["padding_share"] == pytest.approx(implied, abs=0.002)


def test_a_full_fine_tune_over_the_host_budget_is_advised_host_side_changes_that_fit_it():
    """Llama-2-7B, ZeRO-3 with optimizer and parameters on the CPU, on a 64 GiB host: the advice keeps the
    full fine-tune where a host-side change fits (optimizer states on NVMe with fp32 master, DeepSpeed's
    swapper needs them), and every proposal's plan is within the host budget."""
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "llama2-7b-full-offload-2x24gb.yaml"
    host = ["hardware.gpus=1", "hardware.host_memory=64GiB"]
    loaded = load_recipe(recipe, host + ["hardware.nvme_path=/tmp/memtrain-nvme"])
    plan = plan_recipe(loaded.recipe)
    assert plan.headroom_bytes > 0 and plan.host_bytes > 64 * GiB and not plan.fits
    advice = advise(loaded)
    # first the full fine-tune on the GPU, stepped in backward by paged 8-bit AdamW (the 32 GiB-host recipe's way)
    in_backward = advice[0]
    assert "optimizer.step_in_backward=true" in in_backward.overrides
    assert "batch.micro_batch=16" in in_backward.overrides  # the recipe's global batch, one micro-batch per step
    assert in_backward.plan.zero_stage == 0 and in_backward.plan.host_phases["training"] < 16 * GiB
    assert in_backward.plan.host_bytes < 32 * GiB  # a checkpoint save copies the bf16 weights to the host
    assert advice[1].overrides == ["offload.optimizer=nvme", "offload.zero_stage=3", "precision.master=fp32"]
    assert all(a.plan.fits and a.plan.host_bytes <= 64 * GiB for a in advice)
    assert advice[1].plan.nvme_bytes > 70 * GiB  # fp32 master weights and both moments of 6.7B parameters
    # without an NVMe directory: stepping in backward, else LoRA
    no_nvme = advise(load_recipe(recipe, host))
    assert [a.overrides for a in no_nvme] == [in_backward.overrides, ["model.lora.r=16"]]


def test_the_chat_quickstart_loads_and_plans_from_another_directory(tmp_path, monkeypatch):
    """model.path in recipes/quickstart-chat.yaml is relative to the recipe, not to the repository root."""
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "quickstart-chat.yaml"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEMTRAIN_CACHE", str(tmp_path / "cache"))
    result = CliRunner().invoke(app, ["plan", str(recipe), "--json", "--data"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["data"]["train"]["samples"] > 2000
    assert load_recipe(recipe).recipe.model.path == str(
        recipe.parents[1] / "memtrain" / "assets" / "models" / "shakespeare-mini"
    )


def test_fit_repoints_relative_input_paths_to_the_written_recipe(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "data").mkdir()
    for name in ("t.txt", "v.txt"):
        (tmp_path / "data" / name).write_text("To be, or not to be, that is the question.\n" * 50)
    text = RECIPE.format(gpu="1GiB").replace("train: builtin:shakespeare", "train: ../data/t.txt")
    assert "../data/t.txt" in text
    recipe = tmp_path / "a" / "r.yaml"
    recipe.write_text(text)
    monkeypatch.chdir(tmp_path)
    output = tmp_path / "b" / "c" / "fitted.yaml"
    run(recipe, "data.validation=data/v.txt", fit=True, output=output)
    written = yaml.safe_load(output.read_text())["data"]
    assert written["train"] == "../../data/t.txt" and written["validation"] == "../../data/v.txt"
    assert load_recipe(output, check=False).recipe.data.train == str(tmp_path / "data" / "t.txt")


def test_fit_output_through_a_file_is_a_user_error_not_a_traceback(tmp_path):
    (tmp_path / "chat.yaml").write_text("mine")
    result = CliRunner().invoke(
        app, ["plan", str(write(tmp_path, gpu="1GiB")), "--fit", "-o", str(tmp_path / "chat.yaml" / "f.yaml")]
    )
    assert result.exit_code == 2, result.output
    assert "is a file, where a directory is needed" in result.output and "Traceback" not in result.output
    assert (tmp_path / "chat.yaml").read_text() == "mine"


def test_fit_writes_a_recipe_that_already_fits_as_it_is_with_the_overrides(tmp_path):
    """`plan --fit -o F && memtrain run F` works whether or not the recipe needed a change."""
    output = tmp_path / "fitted.yaml"
    code, text = run(write(tmp_path), "train.steps=7", fit=True, output=output)
    assert code == 0 and f"fits as it is; wrote {output} (no change)" in text
    fitted = load_recipe(output)
    assert fitted.recipe.train.steps == 7 and fitted.recipe.hardware.gpu == "24GiB" and plan_recipe(fitted.recipe).fits
    code, text = run(write(tmp_path), fit=True, output=output)
    assert code == 0 and f"fits as it is; replaced {output} (no change)" in text
    assert load_recipe(output).recipe.train.steps == 10
    as_json = CliRunner().invoke(app, ["plan", str(write(tmp_path)), "--fit", "-o", str(output), "--json"])
    assert as_json.exit_code == 0 and json.loads(as_json.stdout)["fitted_recipe"] == str(output)


def test_fit_says_when_it_replaced_a_file(tmp_path):
    output = tmp_path / "fitted.yaml"
    output.write_text("old: true\n")
    code, text = run(write(tmp_path, gpu="1GiB"), fit=True, output=output)
    assert code == 0 and f"replaced {output} (fits with" in text
    assert plan_recipe(load_recipe(output).recipe).fits


def test_fit_onto_the_recipe_itself_leaves_a_fitting_recipe_untouched(tmp_path):
    path = write(tmp_path)
    before = path.read_text()
    code, text = run(path, fit=True, output=path)
    assert code == 0 and "fits as it is" in text and path.read_text() == before  # comments and all


@pytest.mark.parametrize(
    "gpu, says",
    [
        ("0GiB", "has no memory to plan against"),
        ("0", "has no memory to plan against"),
        ("potato", "neither a GPU profile nor a size"),
    ],
)
def test_gpu_option_must_name_a_card_with_memory(tmp_path, gpu, says):
    result = CliRunner().invoke(app, ["plan", str(write(tmp_path)), "--gpu", gpu])
    assert result.exit_code == 2, result.output
    assert "<command line>: --gpu: " in result.output and says in result.output and "Traceback" not in result.output
    assert "hardware.gpu" not in result.output  # the flag is wrong, not the recipe's key


def test_data_option_says_the_datas_warnings(tmp_path):
    """A tokenizer template that writes no special token after an answer: plan --data says so, as run does."""
    from tests.data.render.test_templates import family_tokenizer

    family_tokenizer("plain").save_pretrained(tmp_path / "plain")
    recipe = tmp_path / "plain.yaml"
    recipe.write_text(f"""
model: {{preset: micro, tokenizer: {tmp_path / "plain"}}}
data:
  train: [{{path: "builtin:chat", type: chat}}]
  seq_len: 64
  cache_dir: {tmp_path / "cache"}
batch: {{global_batch: 8, micro_batch: 4}}
train: {{steps: 4}}
""")
    result = CliRunner().invoke(app, ["plan", str(recipe), "--json", "--data"])
    assert result.exit_code == 0, result.output
    warning, prompt, trained_on = json.loads(result.stdout)["data_warnings"]  # and its prompt's trailing space
    assert "held-out prompts also occur in the training data" in trained_on  # builtin:chat's tail (see above)
    assert warning.startswith("model.tokenizer: the tokenizer's chat_template (data.template is not set) writes no")
    assert "generation prompt (add_generation_prompt=True" in prompt
    table = CliRunner().invoke(app, ["plan", str(recipe), "--data"])
    assert "writes no special token after an assistant's answer" in " ".join(table.output.split())


RECIPES = Path(__file__).resolve().parents[2] / "recipes"
# the 7B LoRA recipe with its layers recomputed whole, as the advice rows below were worked out (it ships with the
# compiler's memory budget now)
WHOLE = "checkpointing.strategy=every_layer"


def test_a_recipe_fitted_for_another_card_names_that_card_and_plans_the_same_without_the_flag(tmp_path):
    """`plan R --gpu X --fit -o F` wrote F with R's own card, so `plan F` and `run F`
    (which resolves batch.micro_batch: auto against hardware.gpu) planned for the 24 GB card."""
    recipe, card = RECIPES / "llama2-7b-lora-24gb.yaml", "rtx4060ti-16gb"
    output = tmp_path / "fitted.yaml"
    code, text = run(recipe, WHOLE, gpu=card, fit=True, output=output)
    assert code == 0 and f"wrote {output}" in text
    fitted = load_recipe(output)
    assert fitted.recipe.hardware.gpu == card and fitted.recipe.batch.micro_batch == 2
    assert plan_recipe(fitted.recipe).to_json() == plan_recipe(fitted.recipe, card).to_json()
    # without --fit, the command to apply the advice plans for the same card
    code, text = run(recipe, WHOLE, "train.steps=50", gpu=card)
    assert code == 1
    said = f"apply: memtrain plan {recipe} --gpu {card} {WHOLE} train.steps=50 batch.micro_batch=2"
    assert said in " ".join(text.split())


def test_a_recipe_with_micro_batch_auto_fitted_for_another_card_resolves_auto_for_that_card(tmp_path):
    """What `memtrain run F` does with `batch.micro_batch: auto`: resolve it against hardware.gpu."""
    from memtrain.plan.planner import resolve_micro_batch

    card, output = "rtx4060ti-16gb", tmp_path / "fitted.yaml"
    code, _ = run(RECIPES / "llama2-7b-full-64gb-host.yaml", gpu=card, fit=True, output=output)
    fitted = load_recipe(output).recipe
    assert code == 0 and fitted.batch.micro_batch == "auto" and fitted.hardware.gpu == card
    assert resolve_micro_batch(fitted) == resolve_micro_batch(fitted, card)
    assert plan_recipe(fitted).to_json() == plan_recipe(fitted, card).to_json()


@pytest.mark.parametrize("card", ["1GiB", "1073741824"])
def test_a_card_given_as_a_size_is_written_as_given(tmp_path, card):
    output = tmp_path / "fitted.yaml"
    code, _ = run(write(tmp_path), gpu=card, fit=True, output=output)
    fitted = load_recipe(output).recipe
    assert code == 0 and fitted.hardware.gpu == card  # a string, also where YAML would read a number
    assert plan_recipe(fitted).to_json() == plan_recipe(fitted, card).to_json() and plan_recipe(fitted).fits
    # a recipe that fits the card as it is is written with the card too
    code, text = run(write(tmp_path), gpu="rtx4090", fit=True, output=output)
    assert code == 0 and "fits as it is" in text and load_recipe(output).recipe.hardware.gpu == "rtx4090"


def test_advice_ranks_changes_with_margin_before_tight_ones_and_says_which_are_tight(tmp_path):
    """Gemma-2-9B LoRA on 24 GB misses by 0.86 GiB; bf16 master + micro-batch 2 and
    micro-batch 1 fit with 0.1 GiB, tight, while nf4 fits with 10 GiB. --fit wrote the tight one."""
    preset = ["model.preset=gemma2-9b", WHOLE]
    tight = plan_recipe(load_recipe(RECIPES / "llama2-7b-lora-24gb.yaml", preset + ["batch.micro_batch=1"]).recipe)
    assert tight.fits and tight.tight  # the case --fit wrote
    advice = advise(load_recipe(RECIPES / "llama2-7b-lora-24gb.yaml", preset))
    assert advice and not advice[0].tight and advice[0].plan.fits
    flags = [a.tight for a in advice]
    assert flags == sorted(flags)  # every change with margin before every tight one
    code, text = run(RECIPES / "llama2-7b-lora-24gb.yaml", *preset, as_json=True)
    items = json.loads(text)["advice"]
    assert code == 1 and [item["tight"] for item in items] == flags
    output = tmp_path / "fitted.yaml"
    code, text = run(RECIPES / "llama2-7b-lora-24gb.yaml", *preset, fit=True, output=output)
    fitted = plan_recipe(load_recipe(output).recipe)
    assert code == 0 and fitted.fits and not fitted.tight and "but tight" not in text
    assert "┃ tight ┃" in text


def test_fit_says_when_the_only_change_it_could_write_is_tight(tmp_path, monkeypatch):
    """Where nothing on the list fits with margin, --fit writes the cheapest tight change and says so."""
    import memtrain.commands.plan as plan_module
    from memtrain.plan.advice import Advice

    recipe, preset = RECIPES / "llama2-7b-lora-24gb.yaml", ["model.preset=gemma2-9b", WHOLE]
    tight = plan_recipe(load_recipe(recipe, preset + ["batch.micro_batch=1"]).recipe)
    monkeypatch.setattr(
        plan_module, "advise", lambda *args, **kwargs: [Advice(["batch.micro_batch=1"], tight, 0.1, "micro-batch 1")]
    )
    output = tmp_path / "fitted.yaml"
    code, text = run(recipe, *preset, fit=True, output=output)
    words = " ".join(text.split())
    assert code == 0 and f"! wrote {output}" in words and "but tight" in words and "may run out of memory" in words
    assert re.search(r"│\s+yes\s+│", text)  # the advice table's tight column


def test_a_smaller_micro_batch_costs_by_the_parameter_offload_of_its_own_combination():
    """TinyLlama with the optimizer on the CPU, on a 3 GiB card. An option that adds
    parameter offload and halves the micro-batch re-gathers every parameter twice as often: +50 % per halving
    (docs/PLAN.md), not the +5 % of the recipe's own parameters on the GPU."""
    advice = advise(
        load_recipe(RECIPES / "tinyllama-1.1b-full-offload-24gb.yaml", ["hardware.gpu=3GiB", "batch.micro_batch=4"]),
        limit=5,  # the layer inputs on the host (+15 %) come first now
    )
    costs = {tuple(a.overrides): a.speed_cost for a in advice}
    offload = (
        "offload.optimizer=cpu",
        "offload.params=cpu",
        "offload.zero_stage=3",
        "offload.max_live_parameters=300000000",
    )
    assert costs[("batch.micro_batch=2",) + offload] == 1.14  # 0.6 + 0.5 × 1 halving + 0.04
    assert costs[("batch.micro_batch=1",) + offload] == 1.64  # 0.6 + 0.5 × 2 halvings + 0.04
    assert [a.speed_cost for a in advice] == sorted(a.speed_cost for a in advice)
    order = list(costs)
    assert order.index(("model.lora.r=16", "model.quantize.type=nf4")) < order.index(
        ("batch.micro_batch=1",) + offload
    )  # QLoRA (1.3) before micro-batch 1


def test_plan_and_validate_work_without_the_packages_the_run_will_need(tmp_path):
    """A plan is what one runs before installing anything: a paged 8-bit optimizer and a quantised base are
    priced on a machine without bitsandbytes, and the plan names the package; only a run refuses."""
    import pytest

    from memtrain.checks.environment import Environment, packages_needed
    from memtrain.checks.load import load_checked
    from memtrain.commands.plan import load_for_plan, located_plan
    from memtrain.errors import RecipeError

    recipe = tmp_path / "paged.yaml"
    recipe.write_text(
        "model: {preset: tiny, lora: {r: 8}, quantize: {type: nf4}}\n"
        "data: {train: 'builtin:shakespeare', seq_len: 64}\n"
        "optimizer: {name: paged_adamw_8bit}\n"
        "batch: {global_batch: 8, micro_batch: 2}\n"
        "train: {steps: 2}\n"
    )
    without = Environment(bitsandbytes=False)
    loaded = load_for_plan(recipe, [], without)
    plan = located_plan(loaded, gpu=None, exact_pinned=True)
    with_package = located_plan(load_for_plan(recipe, [], Environment()), gpu=None, exact_pinned=True)
    assert plan.peak_reserved_bytes == with_package.peak_reserved_bytes > 0  # priced from known sizes
    (needed,) = packages_needed(loaded.recipe, without)
    assert needed.startswith("bitsandbytes") and "model.quantize" in needed and "paged_adamw_8bit" in needed
    assert packages_needed(loaded.recipe, Environment()) == []
    load_checked(recipe, [], without, packages=False)  # validate's check: passes
    with pytest.raises(RecipeError, match="needs bitsandbytes, which is not installed"):
        load_checked(recipe, [], without)  # run's check: refuses


def test_data_that_misses_gets_advice_priced_by_its_densest_row(tmp_path):
    """At 55,040 tokens the 32k recipe fits rows of 256-token samples (the assumption) but not its own short
    conversations (1,802 in the densest row): the advice, the fitted recipe and its check must price that row too,
    or every change looks as if it did nothing and the table says nothing fits."""
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "qwen2.5-7b-lora-long-24gb.yaml"
    longer = ["data.seq_len=55040", "batch.global_batch=2", f"data.cache_dir={tmp_path / 'cache'}"]
    assumed = json.loads(CliRunner().invoke(app, ["plan", str(recipe), *longer, "--json", "--no-data"]).stdout)
    assert assumed["verdict"].startswith("fits")
    fitted = tmp_path / "fitted.yaml"
    result = CliRunner().invoke(app, ["plan", str(recipe), *longer, "--json", "--data", "--fit", "-o", str(fitted)])
    assert result.exit_code == 0, result.output
    counted = json.loads(result.stdout)
    assert counted["verdict"].startswith("misses") and counted["plan"]["packed_sequences_counted"]
    assert counted["advice"] and all(option["headroom_bytes"] > 0 for option in counted["advice"])
    assert counted["fitted_recipe"] == str(fitted) and fitted.exists()


def test_small_data_on_this_machine_is_read_without_being_asked_and_large_data_is_not(tmp_path):
    """The plan of long packed rows depends on how many samples a row holds, which only the data says: where the data
    is here and small (under 16 MiB: the bundled sets, a few thousand conversations) `plan` reads it as --data does;
    a larger file it leaves to the assumption (minutes of tokenising), as it does data it cannot read, saying so."""
    from memtrain.commands.plan_data import READ_DATA_BELOW_BYTES

    def planned(*args: str) -> dict:
        result = CliRunner().invoke(app, ["plan", str(RECIPES / "quickstart-chat.yaml"), "--json", *args])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    # bf16: the GPU's flash kernels, whose backward grows with the sequences a row holds (fp32 takes another path)
    cache = [f"data.cache_dir={tmp_path / 'cache'}", "precision.compute=bf16"]
    unasked, asked, refused = planned(*cache), planned(*cache, "--data"), planned(*cache, "--no-data")
    assert unasked["plan"]["packed_sequences_counted"] and not refused["plan"]["packed_sequences_counted"]
    assert unasked["plan"] == asked["plan"] and unasked["data"] == asked["data"]
    assert "data" not in refused and unasked["plan"]["packed_sequences"] > refused["plan"]["packed_sequences"]
    # one more conversation than fits under the size: not read unless asked
    line = json.dumps({"messages": [{"role": "user", "content": "Speak."}, {"role": "assistant", "content": "Aye."}]})
    large = tmp_path / "large.jsonl"
    large.write_text((line + "\n") * (READ_DATA_BELOW_BYTES // (len(line) + 1) + 1))
    assert large.stat().st_size >= READ_DATA_BELOW_BYTES
    train = f"data.train=[{{path: {large}, type: chat}}]"
    assert not planned(*cache, train, "data.validation=null")["plan"]["packed_sequences_counted"]
    # small but unreadable: the assumption, and the record's problem said; asked, the problem is the command's
    bad = tmp_path / "bad.jsonl"
    bad.write_text(line + "\nnot json\n")
    train = f"data.train=[{{path: {bad}, type: chat}}]"
    unread = planned(*cache, train, "data.validation=null")
    assert not unread["plan"]["packed_sequences_counted"]
    assert unread["data_unread"] == f"{bad}:2: invalid JSON: Expecting value (column 1)"
    said = CliRunner().invoke(
        app, ["plan", str(RECIPES / "quickstart-chat.yaml"), *cache, train, "data.validation=null"]
    )
    assert said.exit_code == 0 and "the data was not read" in " ".join(said.output.split())
    asked = CliRunner().invoke(
        app, ["plan", str(RECIPES / "quickstart-chat.yaml"), *cache, train, "data.validation=null", "--data"]
    )
    assert asked.exit_code == 2 and "invalid JSON" in asked.output
