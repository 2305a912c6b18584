"""Checkpoint strategies leave the math where it was and recompute/offload exactly what they say."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from memtrain.errors import RecipeError
from memtrain.model.recompute import apply_checkpointing, checkpoint_plan
from memtrain.model.wrapper import TrainableLM
from memtrain.recipe.recompute_rules import rule_problems
from memtrain.recipe.schema import Checkpointing, Precision
from tests.model.test_support import one_torch_thread, shakespeare_batches, tiny_llama  # noqa: F401 (autouse fixture)

STEPS = 30
FP32 = Precision(compute="fp32", chunked_loss=True, loss_chunk_tokens=16)

STRATEGIES = {
    "every_layer": Checkpointing(strategy="every_layer"),
    "every_2_layers": Checkpointing(strategy="every_n_layers", every_n_layers=2),
    "every_8_layers": Checkpointing(strategy="every_n_layers", every_n_layers=8),
    "first_3_layers": Checkpointing(strategy="first_n_layers", first_n_layers=3),
    "selective": Checkpointing(strategy="selective"),
    "rules_branches": Checkpointing(
        strategy="rules",
        rules={"model.embed_tokens": "save", "model.layers.*.self_attn": "recompute", "model.layers.*.mlp": "offload"},
    ),
    "rules_layers_offload": Checkpointing(
        strategy="rules", rules={"model.layers.0": "save", "model.layers.*": "offload"}
    ),
}


def train(model, steps: int = STEPS, lr: float = 1e-3):
    """Losses of `steps` AdamW steps, and the gradients after the first step."""
    lm = TrainableLM(model, FP32)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses, first_grads = [], None
    for ids in shakespeare_batches(steps):
        loss_sum, n_tokens = lm(input_ids=ids, labels=ids)
        loss = loss_sum / n_tokens
        loss.backward()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64), first_grads


@pytest.fixture(scope="module")
def reference():
    return train(tiny_llama())


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_strategy_keeps_losses_and_gradients(name, reference):
    ref_losses, ref_grads = reference
    model = tiny_llama()
    apply_checkpointing(model, STRATEGIES[name])
    losses, grads = train(model)
    assert ref_losses[-1] < ref_losses[0] - 0.5  # the run really trains
    assert torch.allclose(losses, ref_losses, rtol=0, atol=1e-5), (losses - ref_losses).abs().max()
    assert grads.keys() == ref_grads.keys()
    for n, g in grads.items():
        assert torch.allclose(g, ref_grads[n], rtol=1e-5, atol=1e-6), n


def _calls_per_module(model, names):
    """Count forward executions of each named module (forward hooks fire on recompute too)."""
    counts = dict.fromkeys(names, 0)
    modules = dict(model.named_modules())
    for name in names:
        modules[name].register_forward_hook(lambda *_, n=name: counts.__setitem__(n, counts[n] + 1))
    return counts


@pytest.mark.parametrize(
    "name, recomputed_layers",
    [
        ("every_layer", [0, 1, 2, 3]),
        ("every_2_layers", [0, 2]),
        ("every_8_layers", [0]),
        ("first_3_layers", [0, 1, 2]),
        ("selective", [0, 1, 2, 3]),
        ("rules_branches", [0, 1, 2, 3]),
        ("rules_layers_offload", []),
    ],
)
def test_exactly_the_planned_blocks_run_twice(name, recomputed_layers):
    model = tiny_llama()
    plan = apply_checkpointing(model, STRATEGIES[name])
    attn = [f"model.layers.{i}.self_attn.q_proj" for i in range(4)]
    mlp = [f"model.layers.{i}.mlp.gate_proj" for i in range(4)]
    counts = _calls_per_module(model, attn + mlp)
    ids = shakespeare_batches(1)[0]
    loss_sum, _ = TrainableLM(model, FP32)(input_ids=ids, labels=ids)
    loss_sum.backward()
    attn_runs = [counts[n] for n in attn]
    assert attn_runs == [2 if i in recomputed_layers else 1 for i in range(4)]
    mlp_recomputed = name != "rules_branches"  # there the MLP is offloaded, not recomputed
    assert [counts[n] for n in mlp] == [2 if i in recomputed_layers and mlp_recomputed else 1 for i in range(4)]
    assert plan.num_layers == 4
    if name.startswith(("every", "first")):
        assert plan.layers_with("recompute") == recomputed_layers


def test_selective_plan_saves_embeddings_and_recomputes_branches():
    plan = checkpoint_plan(tiny_llama(), STRATEGIES["selective"])
    assert plan.actions["model.embed_tokens"] == "save"
    assert sorted(plan.branches_with("recompute")) == sorted(
        f"model.layers.{i}.{b}" for i in range(4) for b in ("self_attn", "mlp")
    )
    assert plan.layers_with("recompute") == []


def test_rules_first_match_wins_and_nested_matches_are_covered():
    plan = checkpoint_plan(tiny_llama(), STRATEGIES["rules_layers_offload"])
    assert plan.actions["model.layers.0"] == "save"
    assert plan.layers_with("offload") == [1, 2, 3]
    assert "model.layers.1.self_attn" not in plan.actions  # inside an offloaded layer
    assert not [n for n in plan.actions if n.startswith("model.layers.0.")]  # '*' stays within one name part


def test_offloaded_activations_live_on_the_host_during_forward():
    """Tensors saved inside offloaded layers go through the offload hooks and are on the CPU,
    while everything else is still saved normally; parameters are never copied."""
    model = tiny_llama()
    plan = apply_checkpointing(model, STRATEGIES["rules_layers_offload"])
    outside: list[torch.Tensor] = []
    seen_at_norm = {}

    def record(tensor):
        outside.append(tensor)
        return tensor

    # The final norm runs after all layers and before backward: the moment to look at the hooks.
    model.model.norm.register_forward_pre_hook(
        lambda *_: seen_at_norm.update(
            packed=plan.offload_stats.packed_tensors,
            devices=set(plan.offload_stats.packed_devices),
            unpacked=plan.offload_stats.unpacked_tensors,
        )
    )
    ids = shakespeare_batches(1)[0]
    with torch.autograd.graph.saved_tensors_hooks(record, lambda t: t):
        loss_sum, _ = TrainableLM(model, FP32)(input_ids=ids, labels=ids)
    assert seen_at_norm["packed"] > 0 and seen_at_norm["devices"] == {"cpu"} and seen_at_norm["unpacked"] == 0
    # Without offload the same forward saves the offloaded tensors through the outer hook instead.
    plain: list[torch.Tensor] = []
    plain_model = tiny_llama()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: plain.append(t) or t, lambda t: t):
        TrainableLM(plain_model, FP32)(input_ids=ids, labels=ids)
    stats = plan.offload_stats
    # Every tensor is saved once: outside the offloaded layers, moved to the host, or a parameter left in place.
    assert len(plain) == len(outside) + stats.packed_tensors + stats.parameters_left_in_place
    params = {p.untyped_storage().data_ptr() for p in plain_model.parameters()}
    params_in_offloaded_layers = sum(t.untyped_storage().data_ptr() in params for t in plain) - sum(
        t.untyped_storage().data_ptr() in {p.untyped_storage().data_ptr() for p in model.parameters()} for t in outside
    )
    assert stats.parameters_left_in_place == params_in_offloaded_layers > 0
    loss_sum.backward()
    assert plan.offload_stats.unpacked_tensors == plan.offload_stats.packed_tensors


@pytest.mark.slow  # 5-20 s on two cores: plain pytest stays under 2 minutes; scripts/test.sh (CI) runs it
def test_lora_strategies_match_plain_lora():
    def lora_losses(config):
        base = tiny_llama()
        torch.manual_seed(1)  # LoRA's A matrices are drawn from the global generator
        model = get_peft_model(
            base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
        )
        plan = apply_checkpointing(model, config) if config else None
        return train(model, steps=10, lr=1e-2)[0], plan

    reference, _ = lora_losses(None)
    assert reference[-1] < reference[0]
    for name in ("every_layer", "selective", "rules_branches"):
        losses, plan = lora_losses(STRATEGIES[name])
        assert plan.num_layers == 4
        assert torch.allclose(losses, reference, rtol=0, atol=1e-5), (name, (losses - reference).abs().max())


@pytest.mark.parametrize(
    "pattern",
    [
        "*.self_attn.q_proj",
        "model.layers.*.input_layernorm",
        "*norm*",
        "model.layers.*.mlp.act_fn",
        "*",
        "model.layers.*.*",
        "*_proj",
    ],
)
def test_rules_that_cut_inside_a_residual_block_are_problems(pattern):
    problems = rule_problems({pattern: "recompute", "model.embed_tokens": "save"})
    assert [p for p, _ in problems] == [pattern]
    assert "residual" in problems[0][1]
    assert rule_problems({pattern: "save"}) == []


@pytest.mark.parametrize(
    "pattern",
    [
        "model.layers.*",
        "model.layers.3",
        "model.layers.[0-7]",
        "*.self_attn",
        "model.layers.*.mlp",
        "transformer.h.*.attn",
        "model.embed_tokens",
        "model.norm",
        "lm_head",
        "*.layers.*",
    ],
)
def test_whole_blocks_are_fine(pattern):
    assert rule_problems({pattern: "recompute"}) == []
    assert rule_problems({pattern: "offload"}) == []


def test_applying_bad_rules_raises_a_recipe_error_naming_the_rule():
    with pytest.raises(RecipeError, match="q_proj"):
        apply_checkpointing(tiny_llama(), Checkpointing(strategy="rules", rules={"*.q_proj": "recompute"}))
    with pytest.raises(RecipeError, match="model.decoder.layers") as err:
        apply_checkpointing(
            tiny_llama(), Checkpointing(strategy="rules", rules={"model.decoder.layers.*": "recompute"})
        )
    assert err.value.problems[0].key == "checkpointing.rules.model.decoder.layers.*"
    assert "model.embed_tokens" in err.value.problems[0].hint


def test_offloaded_layer_inputs_go_to_the_host_and_the_layers_are_recomputed(reference):
    """checkpointing.offload_inputs: each recomputed layer's input (one tensor of batch x seq x hidden) is the
    only tensor moved to the host, the layers run twice, and the math is unchanged."""
    config = Checkpointing(strategy="every_layer", offload_inputs=True)
    model = tiny_llama()
    plan = apply_checkpointing(model, config)
    attn = [f"model.layers.{i}.self_attn.q_proj" for i in range(4)]
    counts = _calls_per_module(model, attn)
    ids = shakespeare_batches(1)[0]
    loss_sum, _ = TrainableLM(model, FP32)(input_ids=ids, labels=ids)
    stats = plan.offload_stats
    hidden = model.config.hidden_size
    assert stats.packed_tensors == 4 and stats.packed_devices == {"cpu"}
    assert stats.packed_bytes == 4 * ids.numel() * hidden * 4  # fp32 layer inputs, one per layer
    loss_sum.backward()
    assert [counts[n] for n in attn] == [2, 2, 2, 2]
    assert stats.unpacked_tensors == stats.packed_tensors
    ref_losses, ref_grads = reference
    losses, grads = train(tiny_llama_with(config))
    assert torch.allclose(losses, ref_losses, rtol=0, atol=1e-5), (losses - ref_losses).abs().max()
    for n, g in grads.items():
        assert torch.allclose(g, ref_grads[n], rtol=1e-5, atol=1e-6), n


def tiny_llama_with(config: Checkpointing):
    model = tiny_llama()
    apply_checkpointing(model, config)
    return model
