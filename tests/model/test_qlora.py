"""QLoRA: quantised base weights (bitsandbytes) under LoRA, on the CPU through real DeepSpeed.

What is specified here: the planner's bytes of quantised weights equal the bytes of the real
tensors; a quantised preset or local directory quantises exactly transformers' layers; DeepSpeed's
bf16 engine leaves the packed weights alone and only the adapters train; the exported adapter loads
on the unquantised base; the 8-bit / paged optimizers train; the advice proposes nf4 when LoRA
alone does not fit; impossible combinations are refused with exit 2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from memtrain.cli import app
from memtrain.ds_config.compiler import ds_config
from memtrain.model.build import build_model
from memtrain.model.quantize import quantized_bytes, quantized_linear_names
from memtrain.plan.params import count_parameters
from memtrain.plan.quantized import quantized_weight_bytes
from memtrain.recipe.load import load_recipe, load_recipe_text
from memtrain.recipe.schema import Lora, Model, Quantize
from tests.conftest import train_losses

bnb = pytest.importorskip("bitsandbytes", reason="QLoRA tests need bitsandbytes (pip install -e .[dev])")

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
QLORA = {
    "model": {"quantize": {"type": "nf4"}, "lora": {"r": 8, "alpha": 16, "dropout": 0.0}},
    "checkpointing": {"strategy": "every_layer"},
    "precision": {"compute": "bf16"},
    "optimizer": {"lr": 3.0e-2},
}


def quantized(
    preset: str = "micro", kind: str = "nf4", double_quant: bool = True, lora: bool = False, seed: int = 0
) -> torch.nn.Module:
    model = Model(
        preset=preset,
        quantize=Quantize(type=kind, double_quant=double_quant),
        lora=Lora(r=4, dropout=0.0) if lora else None,
    )
    return build_model(model, "bf16", CPU, seed=seed)


def packed_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every quantised weight's packed data and first-level scales, by parameter name (copies)."""
    state = {}
    for name, p in module.named_parameters():
        if isinstance(p, bnb.nn.Params4bit):
            state[name] = p.data.clone()
            state[name + ".absmax"] = p.quant_state.absmax.clone()
    return state


# --- the planner's bytes against the real tensors ---------------------------------------------------


def test_bytes_of_one_nf4_matrix_by_hand():
    """4096 × 4096 in nf4 with double quantisation, counted by hand from bitsandbytes' layout."""
    numel = 4096 * 4096
    packed = numel // 2  # two 4-bit codes per byte
    blocks = numel // 64  # one uint8 absmax code per block of 64
    nested = (blocks // 256) * 4  # one fp32 scale per 256 blocks
    constants = 4 + 256 * 4 + 16 * 4  # fp32 offset, the second level's code table, the nf4 code table
    assert quantized_weight_bytes(numel, 4096, "nf4", True) == packed + blocks + nested + constants == 8_655_940
    assert quantized_weight_bytes(numel, 4096, "nf4", False) == packed + blocks * 4 + 16 * 4  # fp32 absmax
    assert quantized_weight_bytes(numel, 4096, "int8", False) == numel + 4096 * 4  # fp32 scale per row
    assert 0.515 < 8_655_940 / numel < 0.517


@pytest.mark.parametrize("kind,double_quant", [("nf4", True), ("nf4", False), ("fp4", True), ("int8", False)])
def test_planner_counts_the_real_bytes_of_the_quantised_tiny_model(kind, double_quant):
    lm = quantized("tiny", kind, double_quant)
    counts = count_parameters(Model(preset="tiny", quantize=Quantize(type=kind, double_quant=double_quant)))
    assert counts.quantized_bytes == quantized_bytes(lm)
    layers = [m for m in lm.modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))]
    assert len(layers) == 4 * 7
    assert counts.quantized == sum(m.in_features * m.out_features for m in layers)
    # what is not quantised (embeddings, norms, lm_head) stays in bf16, counted at 2 bytes
    unquantised = [p for p in lm.parameters() if p.is_floating_point()]
    assert all(p.dtype == torch.bfloat16 for p in unquantised)
    assert counts.weight_bytes(2) == counts.quantized_bytes + 2 * sum(p.numel() for p in unquantised)


def test_every_linear_but_the_head_is_quantised_as_transformers_would():
    lm = quantized("micro")
    kinds = {name: type(m).__name__ for name, m in lm.named_modules()}
    assert kinds["lm_head"] == "Linear"
    assert kinds["model.embed_tokens"] == "Embedding"
    projections = [n for n in kinds if n.endswith("_proj")]
    assert len(projections) == 2 * 7 and all(kinds[n] == "Linear4bit" for n in projections)
    assert sorted(quantized_linear_names(lm)) == []  # nothing plain is left to quantise


def test_a_local_directory_loads_quantised_and_counts_the_same(tmp_path):
    from transformers import AutoModelForCausalLM

    from memtrain.model.config import model_config

    torch.manual_seed(0)
    full = AutoModelForCausalLM.from_config(model_config(Model(preset="micro")), dtype=torch.bfloat16)
    full.save_pretrained(tmp_path / "micro")
    model = Model(path=str(tmp_path / "micro"), quantize=Quantize(type="nf4"))
    lm = build_model(model, "bf16", CPU)
    q_proj = lm.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, bnb.nn.Linear4bit)
    assert count_parameters(model).quantized_bytes == quantized_bytes(lm)
    # the 4-bit weights are the saved weights within nf4's error
    restored = bnb.functional.dequantize_4bit(q_proj.weight.data, q_proj.weight.quant_state)
    original = full.model.layers[0].self_attn.q_proj.weight
    assert (restored.float() - original.float()).abs().mean() < 0.1 * original.float().abs().mean()


def test_a_quantised_preset_has_the_presets_initial_distributions():
    """Materialised module by module, each module still gets the model's own _init_weights."""
    lm = quantized("tiny")
    down = lm.model.layers[1].mlp.down_proj
    weight = bnb.functional.dequantize_4bit(down.weight.data, down.weight.quant_state).float()
    std = lm.config.initializer_range
    assert abs(weight.std().item() - std) < 0.1 * std
    assert abs(lm.model.embed_tokens.weight.float().std().item() - std) < 0.05 * std
    assert torch.equal(lm.model.norm.weight, torch.ones_like(lm.model.norm.weight))
    assert torch.allclose(lm.model.rotary_emb.inv_freq[:2], torch.tensor([1.0, 10000 ** (-2 / 64)]))


def test_a_quantised_preset_is_reproducible_for_a_seed():
    one, two, other = packed_state(quantized(seed=3)), packed_state(quantized(seed=3)), packed_state(quantized(seed=4))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    assert not all(torch.equal(one[k], other[k]) for k in one)


# --- the plan and the advice ------------------------------------------------------------------------


def test_the_plan_counts_quantised_weights_for_the_13b_recipe():
    from memtrain.plan.planner import plan_recipe

    loaded = load_recipe(ROOT / "recipes" / "llama2-13b-qlora-24gb.yaml")
    plan = plan_recipe(loaded.recipe)
    counts = count_parameters(loaded.recipe.model)
    assert plan.params == counts.weight_bytes(2)
    assert 6.5 * 2**30 < plan.params < 7.2 * 2**30  # 12.7 B weights at ~0.52 B + embeddings/head in bf16
    assert plan.phases["init"] < 8 * 2**30  # the bf16 model (24 GiB) is never built
    assert plan.fits


@pytest.mark.slow  # 5-20 s on two cores: plain pytest stays under 2 minutes; scripts/test.sh (CI) runs it
def test_advice_proposes_nf4_when_lora_alone_does_not_fit():
    from memtrain.plan.advice import advise, with_overrides
    from memtrain.plan.planner import plan_recipe

    loaded = load_recipe(ROOT / "recipes" / "llama2-7b-lora-24gb.yaml", ["model.preset=llama2-13b"], check=False)
    assert not plan_recipe(loaded.recipe).fits
    advice = advise(loaded)
    nf4 = [a for a in advice if "model.quantize.type=nf4" in a.overrides]
    assert nf4, [a.overrides for a in advice]
    assert plan_recipe(with_overrides(loaded, nf4[0].overrides).recipe).fits
    # quantised weights never come with ZeRO-3 parameter offload, which the checks refuse
    assert not any("offload.params=cpu" in a.overrides for a in nf4)


def test_advice_for_a_full_fine_tune_adds_lora_with_nf4():
    from memtrain.plan.advice import _quantize_options
    from memtrain.recipe.load import load_recipe_text

    loaded = load_recipe_text(
        "model: {preset: llama2-13b}\ndata: {train: 'builtin:shakespeare'}\ntrain: {steps: 1}\n", check=False
    )
    options = _quantize_options(loaded.recipe)
    assert options[1].overrides == ("model.lora.r=16", "model.quantize.type=nf4")


# --- compile and checks -----------------------------------------------------------------------------

BASE = """
model: {preset: micro, lora: {r: 4}, quantize: {type: nf4}}
data: {train: "builtin:shakespeare", seq_len: 64}
train: {steps: 10}
"""


@pytest.mark.parametrize("name", ["adamw_8bit", "paged_adamw", "paged_adamw_8bit"])
def test_bnb_optimizers_are_client_optimizers_without_a_config_block(name, monkeypatch):
    import deepspeed.comm as ds_comm
    from deepspeed.runtime.config import DeepSpeedConfig

    recipe = load_recipe_text(BASE, overrides=[f"optimizer.name={name}"]).recipe
    config = ds_config(recipe, micro_batch=4)
    assert "optimizer" not in config and config["zero_allow_untested_optimizer"] is True
    monkeypatch.setattr(ds_comm, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(ds_comm, "get_world_size", lambda *a, **k: 1)
    DeepSpeedConfig(config)
    adamw = ds_config(load_recipe_text(BASE).recipe, micro_batch=4)
    assert adamw["optimizer"]["params"]["torch_adam"] is True and adamw["optimizer"]["params"]["fused"] is True


@pytest.mark.parametrize(
    "overrides,key,words",
    [
        (["model.lora=null"], "model.quantize", "LoRA"),
        (["offload.params=cpu", "offload.optimizer=cpu"], "offload.params", "ZeRO-3"),
        (["offload.zero_stage=3"], "offload.zero_stage", "quantisation constants"),
        (["precision.mode=autocast"], "precision.mode", "fp32"),
        (["optimizer.name=adamw_8bit", "offload.optimizer=cpu"], "optimizer.name", "CPU Adam"),
    ],
)
def test_impossible_combinations_exit_2_naming_the_key_and_why(tmp_path, overrides, key, words):
    path = tmp_path / "bad.yaml"
    path.write_text(BASE)
    result = CliRunner().invoke(app, ["validate", str(path), *overrides])
    assert result.exit_code == 2, result.output
    line = next(line for line in result.output.splitlines() if f": {key}: " in line)
    assert words in line and " — " in line, line


def test_shipped_qlora_recipes_fit_their_cards():
    from memtrain.plan.planner import plan_recipe

    for name, gpu_gib in (("llama2-13b-qlora-24gb", 24), ("llama2-7b-qlora-16gb", 16)):
        plan = plan_recipe(load_recipe(ROOT / "recipes" / f"{name}.yaml").recipe)
        assert plan.fits and plan.gpu_capacity_bytes == gpu_gib * 2**30, name


# --- DeepSpeed engines on the CPU -------------------------------------------------------------------


@pytest.mark.slow  # 5-20 s on two cores: plain pytest stays under 2 minutes; scripts/test.sh (CI) runs it
@pytest.mark.parametrize("kind,optimizer", [("nf4", "adamw_8bit"), ("int8", "adamw")])
def test_deepspeed_bf16_engine_trains_only_adapters_and_keeps_the_packed_weights(
    process_group, write_recipe, kind, optimizer
):
    from memtrain.ds_config.compiler import ds_config
    from memtrain.train.setup import build_engine, build_policy_model
    from tests.model.test_support import shakespeare_batches

    path = write_recipe(
        "engine",
        {
            **QLORA,
            "model": {**QLORA["model"], "quantize": {"type": kind}},
            "optimizer": {"name": optimizer, "lr": 3.0e-2},
        },
    )
    loaded = load_recipe(path)
    config = ds_config(loaded.recipe, micro_batch=2)
    model = build_policy_model(loaded.recipe, process_group, config)
    engine, _ = build_engine(loaded.recipe, model, config, total_steps=10)
    fresh = build_model(loaded.recipe.model, "bf16", CPU, seed=loaded.recipe.train.seed)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # deepspeed.initialize cast the module with .bfloat16(): packed weights and their constants are untouched
    frozen_packed = {n: p for n, p in model.named_parameters() if not p.is_floating_point()}
    assert frozen_packed and all(
        p.dtype == (torch.uint8 if kind == "nf4" else torch.int8) for p in frozen_packed.values()
    )
    assert all(torch.equal(p, dict(fresh.named_parameters())[n]) for n, p in frozen_packed.items())
    if kind == "nf4":
        assert all(p.quant_state is not None for p in frozen_packed.values())
        assert all(torch.equal(a, b) for a, b in zip(packed_state(model).values(), packed_state(fresh).values()))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if n in trainable)

    losses = []
    for ids in shakespeare_batches(6):
        loss_sum, tokens = engine(input_ids=ids, labels=ids)
        engine.backward(loss_sum / tokens)
        engine.step()
        losses.append(float(loss_sum.detach() / tokens))
    after = dict(model.named_parameters())
    changed = {n for n, p in before.items() if not torch.equal(p, after[n].detach())}
    assert changed and changed <= trainable  # only adapters moved (lora_A and lora_B)
    assert any(".lora_B." in n for n in changed)
    if kind == "nf4":
        assert all(torch.equal(a, b) for a, b in zip(packed_state(model).values(), packed_state(fresh).values()))
    if optimizer == "adamw_8bit":
        states = [s for s in engine.optimizer.optimizer.state.values() if "state1" in s]
        assert states and all(s["state1"].dtype == torch.uint8 for s in states)  # 8-bit moments
    assert all(torch.isfinite(torch.tensor(losses)))


# --- end to end -------------------------------------------------------------------------------------


def _run(path: Path, save: bool = True) -> int:
    from memtrain.commands.run import run_command
    from memtrain.train.resolve import RunOptions

    return run_command(path, [], RunOptions(save=save))


def _mean(losses: dict[int, float], steps) -> float:
    return sum(losses[s] for s in steps) / len(steps)


@pytest.mark.slow
def test_qlora_run_lowers_the_loss_and_exports_an_adapter_for_the_unquantised_base(write_recipe):
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from memtrain.model.config import model_config

    path = write_recipe("qlora", {**QLORA, "train": {"steps": 25, "eval_every": 25}})
    assert _run(path) == 0
    run_dir = Path(load_recipe(path).recipe.train.output_dir)
    losses = train_losses(run_dir)
    first, last = _mean(losses, (1, 2, 3)), _mean(losses, (23, 24, 25))
    assert last < first - 0.05, (first, last)

    final = run_dir / "final"
    saved = load_file(final / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)
    # the adapter on the quantised base it was trained on ...
    recipe = load_recipe(path).recipe
    qlora = PeftModel.from_pretrained(quantized(seed=recipe.train.seed), final)
    # ... and on an unquantised bf16 base holding the same (dequantised) weights
    base = AutoModelForCausalLM.from_config(model_config(Model(preset="micro")), dtype=torch.bfloat16)
    quantized_base = qlora.get_base_model()
    state = {}
    for name, module in quantized_base.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            state[name.removesuffix(".base_layer") + ".weight"] = bnb.functional.dequantize_4bit(
                module.weight.data, module.weight.quant_state
            )
    for name, p in quantized_base.named_parameters():
        if p.is_floating_point() and "lora_" not in name:
            state[name.replace(".base_layer", "")] = p.detach()
    missing, unexpected = base.load_state_dict(state, strict=False)
    assert not missing and not unexpected
    plain = PeftModel.from_pretrained(base, final)
    loaded = {k: v for k, v in get_peft_model_state_dict(plain).items()}
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
    ids = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = qlora.eval()(input_ids=ids).logits.float()
        got = plain.eval()(input_ids=ids).logits.float()
        with plain.disable_adapter():
            without_adapter = plain(input_ids=ids).logits.float()
    # same weights, dequantised per matmul or stored in bf16: at most bf16 rounding (0.0 measured on the CPU)
    difference = (got - expected).abs().max()
    assert difference < 0.02 * expected.abs().max()
    assert (got - without_adapter).abs().max() > 10 * difference + 0.1  # and the trained adapter matters


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adamw_8bit", "paged_adamw_8bit"])
def test_8bit_optimizers_train_qlora(write_recipe, name):
    """On the CPU bitsandbytes runs a paged optimizer unpaged (it warns so): this covers the recipe path and
    the 8-bit states; paging to the host under memory pressure needs CUDA's unified memory."""
    path = write_recipe(
        name, {**QLORA, "optimizer": {"name": name, "lr": 3.0e-2}, "train": {"steps": 20, "eval_every": 100}}
    )
    assert _run(path, save=False) == 0
    losses = train_losses(Path(load_recipe(path).recipe.train.output_dir))
    assert _mean(losses, (18, 19, 20)) < _mean(losses, (1, 2, 3)) - 0.05, losses
