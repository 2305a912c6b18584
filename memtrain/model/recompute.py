"""Activation checkpointing strategies applied to Hugging Face causal LMs.

Every strategy resolves to one action per module: `save` (keep its activations, the default),
`recompute` (non-reentrant `torch.utils.checkpoint` around its forward) or `offload` (its saved
activations go to host memory during forward and come back for backward). Every module is wrapped here,
whole decoder layers too: transformers' own `activation_checkpointing_enable` puts its checkpoint inside the layer's
`forward` in newer releases, where a compiled layer would trace it (memtrain.model.compiled).
"""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memtrain.errors import Problem, RecipeError, UserError
from memtrain.model import layers
from memtrain.model.layers import hf_model
from memtrain.recipe.recompute_rules import RESIDUAL_BRANCHES, rule_problems
from memtrain.recipe.schema import Checkpointing


def name_matches(name: str, pattern: str) -> bool:
    """Whether a dotted module name ends with components matching the pattern's components.

    Wildcards stay inside one component ('model.layers.*' is the layers, not their children) and the
    pattern may match the end of a longer name ('*.mlp', 'lm_head', and PEFT's 'base_model.model.' prefix).
    """
    parts, want = name.split("."), pattern.split(".")
    return len(parts) >= len(want) and all(fnmatch.fnmatchcase(p, w) for p, w in zip(parts[-len(want) :], want))


@dataclass
class OffloadStats:
    """What the offload hooks moved to host memory (counted in forward, for tests and metrics)."""

    packed_tensors: int = 0
    packed_bytes: int = 0
    packed_devices: set[str] = field(default_factory=set)
    unpacked_tensors: int = 0
    parameters_left_in_place: int = 0


@dataclass
class CheckpointPlan:
    """Which modules keep, recompute or offload their activations: what the memory planner reads.

    `actions` maps module names (relative to the Hugging Face model, PEFT wrapper removed) to
    "save" | "recompute" | "offload"; modules not listed keep their activations.
    """

    strategy: str
    num_layers: int
    layer_names: list[str]
    actions: dict[str, str] = field(default_factory=dict)
    offload_stats: OffloadStats = field(default_factory=OffloadStats)

    def layers_with(self, action: str) -> list[int]:
        """Indices of decoder layers whose whole forward has `action`."""
        return [i for i, name in enumerate(self.layer_names) if self.actions.get(name) == action]

    def branches_with(self, action: str) -> list[str]:
        """Names of modules inside decoder layers (attention/MLP blocks) that have `action`."""
        layers = set(self.layer_names)
        return [n for n, a in self.actions.items() if a == action and n.rsplit(".", 1)[0] in layers]


def decoder_layer_names(model: nn.Module) -> list[str]:
    """Names of the decoder layers (memtrain.model.layers finds them), as a checkpointing problem when absent."""
    try:
        return layers.decoder_layer_names(model)
    except UserError as error:
        raise RecipeError([replace(p, key="checkpointing.strategy") for p in error.problems]) from None


def checkpoint_plan(model: nn.Module, config: Checkpointing) -> CheckpointPlan:
    """The plan a checkpointing section gives for this model, without changing it (meta models work)."""
    layers = decoder_layer_names(model)
    plan = CheckpointPlan(strategy=config.strategy, num_layers=len(layers), layer_names=layers)
    if config.strategy == "auto":
        raise ValueError(
            "checkpointing strategy 'auto' is resolved by the planner (memtrain.plan.planner."
            "with_resolved_checkpointing) before it is applied"
        )
    if config.strategy in ("every_layer", "every_n_layers"):
        every = config.every_n_layers if config.strategy == "every_n_layers" else 1
        plan.actions = {name: "recompute" for i, name in enumerate(layers) if i % every == 0}
    elif config.strategy == "first_n_layers":
        plan.actions = {name: "recompute" for name in layers[: config.first_n_layers]}
    elif config.strategy == "selective":
        names = dict(hf_model(model).named_modules())
        embed = hf_model(model).get_input_embeddings()
        plan.actions = {n: "save" for n, m in names.items() if m is embed}
        for layer in layers:
            for child in RESIDUAL_BRANCHES:
                if f"{layer}.{child}" in names:
                    plan.actions[f"{layer}.{child}"] = "recompute"
    elif config.strategy == "rules":
        plan.actions = _resolve_rules(model, config.rules)
    return plan


def _resolve_rules(model: nn.Module, rules: dict[str, str]) -> dict[str, str]:
    """Module name -> action. The first rule (in the order written) that matches a module decides it;
    modules inside one already recomputed or offloaded are covered by it and not wrapped again."""
    bad = rule_problems(rules)
    if bad:
        raise RecipeError(
            [
                Problem(
                    msg,
                    key=f"checkpointing.rules.{pat}",
                    hint="cut at whole blocks: *.self_attn, *.mlp or a whole layer",
                )
                for pat, msg in bad
            ]
        )
    actions: dict[str, str] = {}
    used: set[str] = set()
    covered: list[str] = []
    for name, _ in hf_model(model).named_modules():
        if not name:
            continue
        pattern = next((p for p in rules if name_matches(name, p)), None)
        if pattern is None:
            continue
        used.add(pattern)
        if any(name.startswith(c + ".") for c in covered):
            continue
        actions[name] = rules[pattern]
        if rules[pattern] != "save":
            covered.append(name)
    unused = [p for p in rules if p not in used]
    if unused:
        some = [n for n, _ in hf_model(model).named_modules() if n][:6]
        raise RecipeError(
            [
                Problem(
                    f"rule '{p}' matches no module of {type(hf_model(model)).__name__}",
                    key=f"checkpointing.rules.{p}",
                    hint=f"module names look like {', '.join(some)}",
                )
                for p in unused
            ]
        )
    return actions


class _HostOffload(torch.autograd.graph.save_on_cpu):
    """save_on_cpu that leaves the module's parameters where they are (they live on the device
    anyway; copying them every step would cost a model's worth of PCIe traffic) and counts bytes."""

    def __init__(self, module: nn.Module, stats: OffloadStats):
        super().__init__(pin_memory=torch.cuda.is_available(), device_type="cuda")
        to_host, from_host = self.pack_hook, self.unpack_hook

        def pack(tensor):
            # Parameters are saved as views (weight.t()), so compare storages, read at pack time
            # because ZeRO-3 gathers the parameters only inside each submodule's forward.
            storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
            if tensor.untyped_storage().data_ptr() in storages:
                stats.parameters_left_in_place += 1
                return (False, tensor)
            packed = to_host(tensor)
            stats.packed_tensors += 1
            stats.packed_bytes += tensor.numel() * tensor.element_size()
            stats.packed_devices.add(packed[1].device.type)
            return (True, packed)

        def unpack(packed):
            moved, value = packed
            if not moved:
                return value
            stats.unpacked_tensors += 1
            return from_host(value)

        self.pack_hook, self.unpack_hook = pack, unpack


def _wrap(module: nn.Module, action: str, stats: OffloadStats, inputs_on_host: bool = False) -> None:
    """Replace the module's forward (inside its __call__, so ZeRO-3 hooks stay outside the region).

    inputs_on_host: a recomputed module's inputs go to host memory. The non-reentrant checkpoint saves its inputs
    for the recompute through the saved-tensor hooks outside its region (those of the offload), and everything
    inside the region through its own (dropped, recomputed in backward); the recompute runs after the offload's
    hooks are gone, so only the inputs travel."""
    original = module.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        if not (module.training and torch.is_grad_enabled()):
            return original(*args, **kwargs)
        if action == "recompute" and not inputs_on_host:
            return checkpoint(original, *args, use_reentrant=False, **kwargs)
        if action == "recompute":
            with _HostOffload(module, stats):
                return checkpoint(original, *args, use_reentrant=False, **kwargs)
        with _HostOffload(module, stats):
            return original(*args, **kwargs)

    forward.checkpoint_action = action  # what memtrain.model.compiled looks for: it must compile inside, not around
    module.forward = forward


def apply_checkpointing(model: nn.Module, config: Checkpointing) -> CheckpointPlan:
    """Apply a checkpointing section to a (PEFT-wrapped or plain) Hugging Face causal LM in place.

    Returns the plan: which modules recompute or offload, for the memory planner and for metrics.
    Call before `deepspeed.initialize`; the model must be called with use_cache=False in training.
    """
    plan = checkpoint_plan(model, config)
    modules = dict(hf_model(model).named_modules())
    for name, action in plan.actions.items():
        if action != "save":
            # checkpointing.offload_inputs applies to whole layers only (the recipe checks say so)
            _wrap(modules[name], action, plan.offload_stats, config.offload_inputs and name in plan.layer_names)
    return plan
