"""`train.compile`: every decoder layer compiled, nothing else; training with it matches training without."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memtrain.commands.run import run_command
from memtrain.model.compiled import compile_layers
from tests.conftest import train_losses


def _tiny_lora():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=128,
        max_position_embeddings=32,
    )
    return get_peft_model(
        LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    )


def test_compiles_exactly_the_decoder_layers_under_a_peft_wrapper():
    model = _tiny_lora()
    assert compile_layers(model) == 3
    compiled = sorted(name for name, m in model.named_modules() if "forward" in vars(m))
    assert compiled == [f"base_model.model.model.layers.{i}" for i in range(3)]
    assert all(hasattr(model.get_submodule(name).forward, "_torchdynamo_orig_callable") for name in compiled)


def test_checkpointed_layers_compile_inside_the_checkpoint_without_a_break():
    """The order the run builds them in (memtrain.train.setup): compiled forward, then the checkpoint around it. The
    three layers share two graphs with no break, and train as the eager, checkpointed layers do. Compiling around the
    checkpoint instead made dynamo trace it, and transformers' output recording inside it broke the graph there."""
    import copy

    from torch._dynamo.utils import counters

    from memtrain.model.recompute import apply_checkpointing
    from memtrain.recipe.schema import Checkpointing

    eager = _tiny_lora()
    compiled = copy.deepcopy(eager)
    apply_checkpointing(eager, Checkpointing(strategy="every_layer"))
    torch._dynamo.reset()
    counters.clear()
    try:
        compile_layers(compiled)
        apply_checkpointing(compiled, Checkpointing(strategy="every_layer"))
        with pytest.raises(ValueError, match="compile the layers before"):
            compile_layers(compiled)
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
        losses = []
        for model in (eager, compiled):
            model.train()
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            losses.append(loss)
        graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    finally:
        torch._dynamo.reset()
    assert (graphs, breaks) == (2, 0)  # the first layer's input needs no gradient (frozen embeddings), the others' do
    assert losses[1].item() == pytest.approx(losses[0].item(), rel=1e-5)
    for (name, a), b in zip(
        ((n, p.grad) for n, p in eager.named_parameters() if p.requires_grad),
        (p.grad for p in compiled.parameters() if p.requires_grad),
    ):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        {},
        {
            "model": {"lora": {"r": 4, "alpha": 8, "dropout": 0.1, "lean_dropout": True}},
            "checkpointing": {"strategy": "every_layer"},
        },
    ],
    ids=["full", "lora-lean-dropout-checkpointed"],
)
def test_compiled_layers_train_like_eager_ones(write_recipe, extra):
    """Same losses step by step, with DeepSpeed really running: compilation fuses kernels, it does not change
    the arithmetic beyond rounding (fp32 here)."""
    base = {**extra, "train": {"steps": 4, "eval_every": 100, "save_every": 100}}
    eager, compiled = (
        write_recipe("eager", base),
        write_recipe("compiled", {**base, "train": {**base["train"], "compile": True}}),
    )
    from torch._dynamo.utils import counters

    assert run_command(eager, []) == 0
    counters.clear()
    assert run_command(compiled, []) == 0
    assert counters["stats"]["unique_graphs"] >= 1  # the layers really went through the compiler
    from pathlib import Path

    import yaml
    from safetensors import safe_open

    run_a, run_b = (Path(yaml.safe_load(p.read_text())["train"]["output_dir"]) for p in (eager, compiled))
    a, b = train_losses(run_a), train_losses(run_b)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4, abs=1e-5), step
    assert a[4] < a[1]  # it trained
    # the export holds the model's own names: compiling in place adds no wrapper prefix
    weights = "adapter_model.safetensors" if "lora" in extra.get("model", {}) else "model.safetensors"
    keys = []
    for run_dir in (run_a, run_b):
        with safe_open(run_dir / "final" / weights, "pt") as exported:
            keys.append(sorted(exported.keys()))
    assert keys[0] == keys[1] and not any("_orig_mod" in k for k in keys[1])


@pytest.mark.slow
def test_a_memory_budget_trains_like_layers_recomputed_whole(write_recipe):
    """checkpointing.strategy memory_budget changes what backward keeps, not what it computes: the same losses step by
    step as eager layers recomputed whole, with DeepSpeed on the CPU, where auto compiles the layers for the budget."""
    import json
    from pathlib import Path

    import yaml

    steps = {"steps": 4, "eval_every": 100, "save_every": 100}
    whole = write_recipe("whole", {"checkpointing": {"strategy": "every_layer"}, "train": {**steps, "compile": False}})
    budget = write_recipe(
        "budget", {"checkpointing": {"strategy": "memory_budget", "memory_budget": 0.2}, "train": steps}
    )
    assert run_command(whole, []) == 0
    assert run_command(budget, []) == 0
    run_a, run_b = (Path(yaml.safe_load(p.read_text())["train"]["output_dir"]) for p in (whole, budget))
    assert json.loads((run_b / "run.json").read_text())["recipe"]["train"]["compile"] is True
    a, b = train_losses(run_a), train_losses(run_b)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4, abs=1e-5), step


def test_a_layer_the_compiler_cannot_compile_runs_eager(monkeypatch):
    """The default compiles layers (train.compile: auto); a compiler failure on some model, PyTorch or driver it was
    not measured on falls back to the eager layer (PyTorch's warning says why) instead of stopping the run."""
    import copy

    import torch._dynamo
    import torch._inductor.compile_fx

    def broken_compiler(*args, **kwargs):
        raise RuntimeError("planted compiler failure")

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", broken_compiler)
    eager = _tiny_lora()
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    # dynamo's own patch restores the setting: pytest's monkeypatch left it hidden, and every later compile failed
    with torch._dynamo.config.patch(suppress_errors=False):
        try:
            assert compile_layers(compiled) == 3
            ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
            losses = [m(input_ids=ids, labels=ids).loss for m in (eager, compiled)]
            for loss in losses:
                loss.backward()
        finally:
            torch._dynamo.reset()
    assert torch.equal(losses[0], losses[1])
    grads = [[p.grad for p in m.parameters() if p.requires_grad] for m in (eager, compiled)]
    assert all(torch.equal(a, b) for a, b in zip(*grads))
