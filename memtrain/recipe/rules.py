"""Rules that relate several fields of a recipe: contradictions found from the recipe alone.

Field-level rules live in the schema. Rules that need the machine, the user's files, a built model
or an installed package run a layer up (`memtrain.checks`), with what they need handed to them;
these read only the recipe (and memtrain's own shipped presets and GPU profiles). Each rule declares
the sections it reads, so that when one section failed validation the rules of the others still run.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field

from memtrain.configs import gpu_profile, model_preset_names
from memtrain.errors import Problem
from memtrain.hub import hub_repo
from memtrain.recipe.recompute_rules import rule_problems
from memtrain.recipe.schema import PREFERENCE_KEYS, Preference
from memtrain.recipe.sources import LoadedRecipe


@dataclass
class Registry:
    """Checks with the recipe sections each reads; `run` skips those that read a section that failed validation."""

    checks: list[tuple[Callable[..., list[Problem]], frozenset[str]]] = field(default_factory=list)

    def reads(self, *sections: str):
        """Register a check with the recipe sections it reads."""

        def register(check):
            self.checks.append((check, frozenset(sections)))
            return check

        return register

    def run(
        self, loaded: LoadedRecipe, *args, skip_sections: set[str] | frozenset[str] = frozenset(), leave_out: tuple = ()
    ) -> list[Problem]:
        problems: list[Problem] = []
        for check, sections in self.checks:
            if not sections & set(skip_sections) and check not in leave_out:
                problems.extend(check(loaded, *args))
        return problems


RULES = Registry()

# Strategies that recompute whole decoder layers: the ones whose layer inputs checkpointing.offload_inputs moves.
WHOLE_LAYER_STRATEGIES = ("every_layer", "every_n_layers", "first_n_layers", "auto")
reads = RULES.reads


def check_rules(loaded: LoadedRecipe, skip_sections: set[str] | frozenset[str] = frozenset()) -> list[Problem]:
    """Every cross-field problem of a recipe (empty when consistent); rules reading a section named in
    `skip_sections` (one that failed validation) are skipped."""
    return RULES.run(loaded, skip_sections=skip_sections)


def gpu_profile_of(loaded: LoadedRecipe):
    """The recipe's GPU profile, or None when hardware.gpu names none (the schema reports that)."""
    try:
        return gpu_profile(loaded.recipe.hardware.gpu)
    except (ValueError, KeyError, TypeError, OSError):
        return None


@reads("model")
def _check_model_choice(loaded: LoadedRecipe) -> list[Problem]:
    model, src = loaded.recipe.model, loaded.sources
    if bool(model.preset) == bool(model.path):
        if model.preset:
            return [
                src.problem(
                    ("model",),
                    "give exactly one of model.preset or model.path, not both",
                    "remove model.path to use the preset, or model.preset to train the local model",
                )
            ]
        return [
            src.problem(
                ("model",),
                "say what to train: model.preset or model.path",
                f"presets: {', '.join(model_preset_names())}; or a local Hugging Face directory",
            )
        ]
    if model.preset and model.preset not in model_preset_names():
        close = difflib.get_close_matches(model.preset, model_preset_names(), n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"presets: {', '.join(model_preset_names())}"
        return [src.problem(("model", "preset"), f"unknown model preset '{model.preset}'", hint)]
    if model.revision is not None and hub_repo(model.path) is None:
        return [
            src.problem(
                ("model", "revision"),
                "model.revision is for a model read from the Hugging Face Hub, and model.path names "
                + (f"the local directory '{model.path}'" if model.path else f"the preset '{model.preset}'"),
                "remove model.revision, or give a Hub id in model.path (org/name, or hub:org/name)",
            )
        ]
    return []


@reads("hardware", "offload")
def _check_nvme_path(loaded: LoadedRecipe) -> list[Problem]:
    r, src = loaded.recipe, loaded.sources
    if "nvme" not in (r.offload.optimizer, r.offload.params):
        return []
    tier = ("offload", "optimizer") if r.offload.optimizer == "nvme" else ("offload", "params")
    if not r.hardware.nvme_path:
        # point at the line that asks for NVMe when the recipe has no nvme_path line to point at
        at = ("hardware", "nvme_path") if ("hardware", "nvme_path") in src.origin else tier
        return [
            src.problem(
                at,
                f"{'.'.join(tier)}=nvme needs hardware.nvme_path",
                f"set hardware.nvme_path to a directory on a fast local disk, or change {'.'.join(tier)}",
            )
        ]
    return []


@reads("hardware", "precision")
def _check_bf16_support(loaded: LoadedRecipe) -> list[Problem]:
    profile = gpu_profile_of(loaded)
    if profile is not None and loaded.recipe.precision.compute == "bf16" and not profile.bf16:
        return [
            loaded.sources.problem(
                ("precision", "compute"),
                f"{profile.name} has no bf16 support",
                "use precision.compute=fp16 with precision.loss_scale",
            )
        ]
    return []


@reads("offload", "precision", "optimizer")
def _check_offload(loaded: LoadedRecipe) -> list[Problem]:
    r, src = loaded.recipe, loaded.sources
    o = r.offload
    problems = []
    # (stage 0 with states offloaded is refused below, with the stage that offload needs)
    bf16_stage0 = o.zero_stage == 0 and o.optimizer == o.params == "none" and r.precision.storage == "bf16"
    if bf16_stage0 and not r.optimizer.step_in_backward:  # in backward, memtrain's hooks update the bf16 weights
        # DeepSpeed 0.19.8 wraps the optimizer of bf16 weights without ZeRO in FP16_UnfusedOptimizer; on the same
        # gradients its Adam steps were 0.75x as long as ZeRO-1/2's and fp32's (tests/train/test_deepspeed_engine.py)
        problems.append(
            src.problem(
                ("offload", "zero_stage"),
                "ZeRO stage 0 with bf16 weights trains differently: DeepSpeed's stage-0 bf16 optimizer took Adam "
                "steps 0.75x as long as ZeRO's on the same gradients",
                "set offload.zero_stage=auto (ZeRO-1 for LoRA on one GPU, else ZeRO-2), or precision.compute=fp32",
            )
        )
    if o.params != "none" and o.zero_stage not in ("auto", 3):
        problems.append(
            src.problem(
                ("offload", "zero_stage"),
                f"offload.params={o.params} needs ZeRO stage 3, not {o.zero_stage}",
                "set offload.zero_stage=3 (or auto)",
            )
        )
    if o.optimizer == "nvme" and o.zero_stage not in ("auto", 3):
        if o.params == "none":  # with parameters offloaded the rule above already asks for stage 3
            problems.append(_nvme_optimizer_below_zero3(loaded, o.zero_stage))
    elif o.optimizer != "none" and o.zero_stage == 0:
        problems.append(
            src.problem(
                ("offload", "zero_stage"),
                f"offload.optimizer={o.optimizer} needs ZeRO stage 1, 2 or 3, not 0",
                "set offload.zero_stage=auto",
            )
        )
    if o.optimizer == "nvme" and r.precision.master == "bf16":
        # DeepSpeed 0.19's optimizer swapper sizes its pinned buffers in the master dtype but swaps fp32 tensors
        # through them: the first optimizer step stops on an assertion
        problems.append(
            src.problem(
                ("precision", "master"),
                "bf16 master weights cannot go to NVMe: DeepSpeed's "
                "optimizer swapper stops at the first step with them",
                "set precision.master=fp32, or offload.optimizer=cpu",
            )
        )
    if o.params == "nvme" and o.optimizer == "none":
        problems.append(
            src.problem(
                ("offload", "optimizer"),
                "parameters on NVMe need the optimizer offloaded too",
                "set offload.optimizer=cpu or nvme",
            )
        )
    if o.ratio < 1.0:
        if o.optimizer != "cpu":
            problems.append(
                src.problem(
                    ("offload", "ratio"),
                    f"a partial offload ratio works only with offload.optimizer=cpu, not {o.optimizer}",
                    "remove offload.ratio or set offload.optimizer=cpu",
                )
            )
        elif r.zero_stage != 3:
            problems.append(
                src.problem(
                    ("offload", "ratio"),
                    "DeepSpeed's partial optimizer offload needs ZeRO stage 3",
                    "set offload.zero_stage=3 or remove offload.ratio",
                )
            )
    return problems


def _nvme_optimizer_below_zero3(loaded: LoadedRecipe, stage: int) -> Problem:
    """Optimizer states on NVMe at an explicit ZeRO stage below 3. DeepSpeed's ZeRO-1/2 optimizer has no NVMe
    swapper: it takes any offload device for the CPU (stage_1_and_2.py, 0.19.8), so the states would stay in
    host memory while the plan priced them on disk, and a host sized by that plan would run out."""
    message = f"offload.optimizer=nvme needs ZeRO stage 3, not {stage}: only ZeRO-3 swaps optimizer states to NVMe"
    if not stage:
        return loaded.sources.problem(("offload", "zero_stage"), message, "set offload.zero_stage=3 (or auto)")
    return loaded.sources.problem(
        ("offload", "zero_stage"),
        f"{message}; DeepSpeed's ZeRO-{stage} optimizer keeps them in host memory and writes "
        "nothing to hardware.nvme_path",
        f"set offload.zero_stage=3 (or auto), or offload.optimizer=cpu to stay at ZeRO-{stage}",
    )


@reads("offload", "precision")
def _check_cpu_adam(loaded: LoadedRecipe) -> list[Problem]:
    """offload.cpu_adam=torch: PyTorch's fused AdamW steps the offloaded optimizer, where DeepSpeed accepts another
    optimizer than its own CPU Adam (tried on DeepSpeed 0.19.8's CPU accelerator: ZeRO-2 and ZeRO-3 train as with
    it; bf16 master weights stop in deepspeed.initialize at "Master weights feature requires ZeRO-2 Offload with
    DeepSpeedCPUAdam", ZeRO-3 likewise; partial offload at "Hybrid Optimizer Only Supports DeepSpeedCPUAdam")."""
    r, src = loaded.recipe, loaded.sources
    o = r.offload
    if o.cpu_adam != "torch":
        return []
    if o.optimizer != "cpu":
        return [
            src.problem(
                ("offload", "cpu_adam"),
                f"offload.cpu_adam=torch chooses how an optimizer offloaded to the "
                f"CPU steps, and offload.optimizer is {o.optimizer}",
                "set offload.optimizer=cpu, or remove offload.cpu_adam",
            )
        ]
    problems = []
    if r.precision.master == "bf16":
        problems.append(
            src.problem(
                ("offload", "cpu_adam"),
                "DeepSpeed keeps bf16 master weights on the host only "
                "with its own CPU Adam (it stops in deepspeed.initialize otherwise)",
                "set offload.cpu_adam=deepspeed, or precision.master=fp32",
            )
        )
    if o.ratio < 1.0:
        problems.append(
            src.problem(
                ("offload", "cpu_adam"),
                "DeepSpeed's partial offload (offload.ratio below 1) steps only with its own CPU Adam",
                "set offload.cpu_adam=deepspeed, or remove offload.ratio",
            )
        )
    return problems


@reads("offload")
def _check_zenflow(loaded: LoadedRecipe) -> list[Problem]:
    # DeepSpeed's ZenFlow at ZeRO-1/2 flattens every weight matrix transposed but hands the model views of the
    # original shape, so after deepspeed.initialize each matrix holds its own transpose, reshaped (0.19.8;
    # tests/train/test_deepspeed_engine.py shows it and fails once DeepSpeed lays the weights out right)
    if not loaded.recipe.offload.zenflow:
        return []
    return [
        loaded.sources.problem(
            ("offload", "zenflow"),
            "DeepSpeed's ZenFlow replaces every weight matrix with its "
            "own transpose, reshaped, inside deepspeed.initialize: the run would fine-tune "
            "scrambled weights",
            "remove offload.zenflow (plain ZeRO-Offload is the same recipe without it)",
        )
    ]


@reads("precision")
def _check_precision(loaded: LoadedRecipe) -> list[Problem]:
    p, src = loaded.recipe.precision, loaded.sources
    problems = []
    if p.loss_scale is not None and p.compute != "fp16":
        problems.append(
            src.problem(
                ("precision", "loss_scale"),
                f"loss scaling is for fp16, but compute is {p.compute}",
                "remove precision.loss_scale, or set precision.compute=fp16",
            )
        )
    if p.mode == "autocast" and p.compute != "bf16":
        problems.append(
            src.problem(
                ("precision", "mode"),
                f"autocast runs matmuls in bf16, but compute is {p.compute}",
                "set precision.compute=bf16, or precision.mode=cast",
            )
        )
    if p.mode == "autocast" and p.master == "bf16":
        problems.append(
            src.problem(
                ("precision", "master"),
                "autocast keeps fp32 weights; bf16 master weights do not apply",
                "set precision.master=fp32",
            )
        )
    if p.master == "bf16" and p.compute != "bf16":
        problems.append(
            src.problem(
                ("precision", "master"),
                f"bf16 master weights need compute bf16, not {p.compute}",
                "set precision.master=fp32",
            )
        )
    return problems


@reads("model", "precision")
def _check_varlen_precision(loaded: LoadedRecipe) -> list[Problem]:
    """PyTorch's variable-length flash kernel (model.attn_implementation: varlen) takes fp16 and bf16 tensors only
    (auto leaves it out in fp32: memtrain.model.attention)."""
    r, src = loaded.recipe, loaded.sources
    if r.model.attn_implementation != "varlen" or r.precision.compute != "fp32":
        return []
    return [
        src.problem(
            ("model", "attn_implementation"),
            "varlen attention runs in fp16 or bf16, and precision.compute is fp32",
            "set model.attn_implementation: auto (sdpa in fp32), or precision.compute: bf16",
        )
    ]


@reads("batch", "hardware")
def _check_batch_split(loaded: LoadedRecipe) -> list[Problem]:
    b, hw, src = loaded.recipe.batch, loaded.recipe.hardware, loaded.sources
    world = hw.world_size  # every process of every node takes an equal share of the global batch
    ranks = (
        f"nodes × gpus × micro_batch = {hw.nodes} × {hw.gpus}" if hw.nodes > 1 else f"gpus × micro_batch = {hw.gpus}"
    )
    processes = f"{world} processes ({hw.nodes} nodes × {hw.gpus} GPUs)" if hw.nodes > 1 else f"{world} GPUs"
    # one problem per recipe: the first of these that holds explains the others
    # the largest micro-batch that splits the global batch evenly, if any (a hint must not lead to the next error)
    splits = next((m for m in range(b.global_batch // world, 0, -1) if b.global_batch % (m * world) == 0), None)
    if isinstance(b.micro_batch, int) and (
        b.micro_batch * world > b.global_batch or b.global_batch % (b.micro_batch * world)
    ):
        exceeds = b.micro_batch * world > b.global_batch
        said = (
            f"{ranks} × {b.micro_batch} exceeds the global batch {b.global_batch}"
            if exceeds
            else f"global batch {b.global_batch} is not divisible by {ranks} × {b.micro_batch}"
        )
        hints = ([f"batch.micro_batch={splits}"] if splits else []) + [
            f"a global batch that is a multiple of {b.micro_batch * world}"
        ]
        return [
            src.problem(("batch", "micro_batch" if exceeds else "global_batch"), said, "use " + ", or ".join(hints))
        ]
    if b.global_batch % world:
        return [
            src.problem(
                ("batch", "global_batch"),
                f"global batch {b.global_batch} cannot be split over {processes}",
                f"use a multiple of {world}",
            )
        ]
    return []


@reads("batch")
def _check_adaptive(loaded: LoadedRecipe) -> list[Problem]:
    a, src = loaded.recipe.batch.adaptive, loaded.sources
    problems = []
    if a.min_micro_batch > a.max_micro_batch:
        problems.append(
            src.problem(
                ("batch", "adaptive", "min_micro_batch"),
                f"min_micro_batch {a.min_micro_batch} exceeds max_micro_batch {a.max_micro_batch}",
                "lower min_micro_batch or raise max_micro_batch",
            )
        )
    if a.grow_below >= a.shrink_above:
        problems.append(
            src.problem(
                ("batch", "adaptive", "grow_below"),
                f"grow_below {a.grow_below} must be below shrink_above {a.shrink_above}",
                "the defaults are 0.70 and 0.90",
            )
        )
    return problems


@reads("train")
def _check_length(loaded: LoadedRecipe) -> list[Problem]:
    t, src = loaded.recipe.train, loaded.sources
    if t.steps is None and t.epochs is None:
        # a key written with no value (train.steps= on the command line, `steps:` in a file) is where to look
        emptied = next((("train", k) for k in ("steps", "epochs") if ("train", k) in src.origin), None)
        if emptied is not None:
            example, other = (
                ("train.steps=1000", "train.epochs") if emptied[1] == "steps" else ("train.epochs=3", "train.steps")
            )
            return [
                src.problem(
                    emptied,
                    "has no value, so nothing says how long to train",
                    f"give it one, for example {example}, or set {other} instead",
                )
            ]
        return [
            src.problem(
                ("train",), "say how long to train: train.steps or train.epochs", "for example train.steps=1000"
            )
        ]
    if t.steps is not None and t.epochs is not None:
        return [src.problem(("train", "epochs"), "give train.steps or train.epochs, not both", "remove one of them")]
    return []


@reads("train", "schedule")
def _check_warmup(loaded: LoadedRecipe) -> list[Problem]:
    r, src = loaded.recipe, loaded.sources
    if r.train.steps is not None and r.schedule.warmup_steps > r.train.steps:
        return [
            src.problem(
                ("schedule", "warmup_steps"),
                f"warmup of {r.schedule.warmup_steps} steps is longer than the whole run ({r.train.steps})",
                f"use at most {r.train.steps} warmup steps",
            )
        ]
    return []


def compile_unsupported(r) -> tuple[str, str] | None:
    """(what is wrong, what to do) when this recipe's layers cannot be compiled (train.compile), else None."""
    if r.zero_stage == 3:
        # optimizer states on NVMe need ZeRO-3 too (_nvme_optimizer_below_zero3): ZeRO-2 keeps them on the CPU
        below = "offload.params=none, offload.optimizer=cpu" if r.offload.optimizer == "nvme" else "offload.params=none"
        return (
            "train.compile works with ZeRO stage 0-2; ZeRO-3 gathers each layer's weights in hooks that "
            "torch.compile would have to trace through",
            f"set train.compile=false, or {below} and offload.zero_stage=2",
        )
    if r.model.quantize is not None:
        return (
            "train.compile cannot compile layers with bitsandbytes' quantised weights: the QLoRA recipe stopped in "
            "torch.compile's partitioner ('Node ... was invalid, but is output'; PyTorch 2.11, bitsandbytes 0.50, "
            "docs/BENCHMARKS.md)",
            "remove train.compile (auto leaves a quantised base eager), or set train.compile=false",
        )
    if r.checkpointing.mlp_tiles != 0:
        return (
            "train.compile cannot compile layers whose MLPs are tiled (checkpointing.mlp_tiles): DeepSpeed's "
            "TiledMLP runs a backward pass of its own inside its autograd function, which torch.compile does not trace",
            "set train.compile=false, or checkpointing.mlp_tiles=0",
        )
    if "offload" in r.checkpointing.rules.values() or r.checkpointing.offload_inputs:
        return (
            "train.compile cannot be combined with activation offload (checkpointing.rules' offload or "
            "checkpointing.offload_inputs: their saved-tensor hooks do not run inside compiled layers)",
            "set train.compile=false, or use recompute without offload",
        )
    return None


def _refused_where_true(loaded: LoadedRecipe, key: str, unsupported) -> list[Problem]:
    """The problem at train.<key> when the recipe says `true` and unsupported(recipe) says why it cannot hold; `auto`
    resolves around the same reasons instead."""
    why = unsupported(loaded.recipe) if getattr(loaded.recipe.train, key) is True else None
    return [loaded.sources.problem(("train", key), *why)] if why else []


@reads("train", "offload", "checkpointing", "model")
def _check_compile(loaded: LoadedRecipe) -> list[Problem]:
    return _refused_where_true(loaded, "compile", compile_unsupported)


def cuda_graphs_unsupported(r) -> tuple[str, str] | None:
    """(what is wrong, what to do) when this recipe's compiled layers cannot replay CUDA graphs (train.cuda_graphs),
    else None. A graph replays fixed shapes and addresses: every micro-batch must have one width, no layer may be
    recomputed (a checkpoint reruns the layer in backward, outside the recorded order), and the layers must be
    compiled, with LoRA adapters the only trainable weights."""
    if r.train.compile is False:
        return (
            "train.cuda_graphs replays the compiled layers' kernels, and train.compile is false",
            "set train.compile=auto (or true), or train.cuda_graphs=auto",
        )
    if r.model.lora is None:
        return (
            "train.cuda_graphs is for LoRA adapters: each micro-batch first gives every trainable weight a gradient "
            "buffer for the replay to add into, which for a full fine-tune is a gradient of the whole model that the "
            "plan does not price, and it was measured only on LoRA",
            "remove train.cuda_graphs (auto leaves full fine-tunes without graphs), or set it to false",
        )
    c = r.checkpointing
    if c.strategy == "memory_budget":
        return (
            "train.cuda_graphs with checkpointing.strategy memory_budget ran out of memory on the GPU: the 7B LoRA "
            "recipe at 2 x 1024 peaked at 23.8 GiB reserved with its layers replayed, 19.4 launched, and its first "
            "step took 86 s to compile instead of 15 (docs/BENCHMARKS.md, 7B LoRA)",
            "set train.cuda_graphs=auto (it leaves a memory budget's layers launched), or checkpointing.strategy=none",
        )
    recomputes = c.strategy != "none" and not (c.strategy == "first_n_layers" and c.first_n_layers == 0)
    if recomputes or c.offload_inputs or c.mlp_tiles != 0:
        return (
            "train.cuda_graphs works only with nothing recomputed (checkpointing.strategy: none): a checkpoint reruns "
            "each layer inside backward, where its recorded graph cannot replay",
            "set checkpointing.strategy=none, or train.cuda_graphs=auto",
        )
    if not r.data.is_text or r.data.groups_by_length:
        return (
            "train.cuda_graphs needs micro-batches of one width (plain text in seq_len windows): rows cut to their "
            "longest sample or packed samples change shape from one micro-batch to the next, and each new shape "
            "records another graph",
            "set train.cuda_graphs=auto, or train on text with data.packing=true",
        )
    return None


@reads("train", "checkpointing", "data", "model")
def _check_cuda_graphs(loaded: LoadedRecipe) -> list[Problem]:
    return _refused_where_true(loaded, "cuda_graphs", cuda_graphs_unsupported)


def memory_budget_unsupported(r) -> tuple[str, str] | None:
    """(what is wrong, what to do) when checkpointing.strategy memory_budget cannot hold for this recipe, else None:
    the budget is what torch.compile's partitioner recomputes, so the decoder layers must be compiled."""
    if r.checkpointing.strategy != "memory_budget":
        return None
    if r.train.compile is False:
        return (
            "checkpointing.strategy memory_budget is carried out by torch.compile, which decides what each compiled "
            "decoder layer recomputes, and train.compile is false",
            "set train.compile=auto (or true), or checkpointing.strategy=every_layer",
        )
    why = compile_unsupported(r)
    if why is not None:
        return (f"checkpointing.strategy memory_budget needs compiled layers, and {why[0]}", why[1])
    return None


@reads("checkpointing", "train", "offload", "model")
def _check_checkpointing(loaded: LoadedRecipe) -> list[Problem]:
    c, src = loaded.recipe.checkpointing, loaded.sources
    problems = []
    why = memory_budget_unsupported(loaded.recipe)
    if why is not None:
        problems.append(src.problem(("checkpointing", "strategy"), *why))
    if c.strategy == "rules" and not c.rules:
        problems.append(
            src.problem(
                ("checkpointing", "rules"),
                "strategy 'rules' needs at least one rule",
                "for example {'model.layers.*.mlp': recompute}",
            )
        )
    if c.rules and c.strategy != "rules":
        problems.append(
            src.problem(
                ("checkpointing", "strategy"),
                f"rules are given but strategy is '{c.strategy}'",
                "set checkpointing.strategy=rules, or remove the rules",
            )
        )
    if c.offload_inputs and c.strategy not in WHOLE_LAYER_STRATEGIES:
        problems.append(
            src.problem(
                ("checkpointing", "offload_inputs"),
                f"offload_inputs puts recomputed layers' inputs on the host; strategy '{c.strategy}' recomputes "
                "no whole layers",
                f"use checkpointing.strategy {', '.join(WHOLE_LAYER_STRATEGIES)}, or checkpointing.rules' offload",
            )
        )
    if c.strategy == "rules":
        for pattern, message in rule_problems(c.rules):
            problems.append(
                src.problem(
                    ("checkpointing", "rules", pattern),
                    message,
                    "cut at whole blocks: *.self_attn, *.mlp or a whole layer",
                )
            )
    return problems


@reads("model", "offload", "precision")
def _check_quantize(loaded: LoadedRecipe) -> list[Problem]:
    r, src = loaded.recipe, loaded.sources
    kind = r.model.quant_type
    if kind is None:
        return []
    problems = []
    if r.model.lora is None:
        problems.append(
            src.problem(
                ("model", "quantize"),
                f"{kind} base weights are frozen, so nothing would train without LoRA adapters",
                "add model.lora (for example model.lora.r=16), or remove model.quantize",
            )
        )
    if r.zero_stage == 3:
        o = r.offload
        # the line that makes it ZeRO-3: parameters offloaded, optimizer states on NVMe (auto), or zero_stage itself
        if o.params != "none":
            at = ("offload", "params")
        elif o.optimizer == "nvme" and o.zero_stage == "auto":
            at = ("offload", "optimizer")
        else:
            at = ("offload", "zero_stage")
        # ZeRO-2 keeps optimizer states offloaded to NVMe on the CPU (_nvme_optimizer_below_zero3)
        below_zero3 = "offload.params=none, offload.optimizer=cpu" if o.optimizer == "nvme" else "offload.params=none"
        problems.append(
            src.problem(
                at,
                f"{kind} weights cannot go through ZeRO-3, which partitions and offloads parameters as flat "
                "floating-point tensors: bitsandbytes packs them into integers whose quantisation constants live "
                "beside the tensor, where ZeRO-3 neither partitions nor gathers them",
                f"set {below_zero3} and offload.zero_stage=auto (ZeRO-2); quantised weights are a quarter "
                "of their bf16 size, which is what makes them fit",
            )
        )
    if r.precision.mode == "autocast":
        problems.append(
            src.problem(
                ("precision", "mode"),
                "autocast stores weights in fp32, but quantised layers "
                "already compute in precision.compute from their packed weights",
                "set precision.mode=cast with model.quantize",
            )
        )
    return problems


@reads("optimizer", "offload")
def _check_client_optimizer(loaded: LoadedRecipe) -> list[Problem]:
    r, src = loaded.recipe, loaded.sources
    name = r.optimizer.name
    if name == "adamw":
        return []
    problems = []
    if r.offload.optimizer != "none":
        problems.append(
            src.problem(
                ("optimizer", "name"),
                f"{name} is bitsandbytes' optimizer, which steps on the device that holds the "
                f"parameters; with offload.optimizer={r.offload.optimizer} DeepSpeed steps its own CPU Adam on the "
                "host and refuses any other optimizer",
                f"set offload.optimizer=none to use {name}, or optimizer.name=adamw to offload",
            )
        )
    return problems


@reads("optimizer", "offload", "precision", "batch", "hardware", "checkpointing")
def _check_step_in_backward(loaded: LoadedRecipe) -> list[Problem]:
    """Each parameter is updated the moment its gradient exists (train/optim/in_backward.py): nothing may need the
    whole step's gradients afterwards, and the weights must be their own (bf16) master copy."""
    r, src = loaded.recipe, loaded.sources
    if not r.optimizer.step_in_backward:
        return []
    why = "with optimizer.step_in_backward each parameter is updated as soon as its gradient exists, so "
    problems = []
    b = r.batch
    if b.micro_batch not in (b.global_batch, "auto") or b.policy != "fixed":  # auto: the global batch (planner.py)
        problems.append(
            src.problem(
                ("batch", "micro_batch"),
                why + "every micro-batch is an optimizer step: there "
                f"is no gradient to accumulate (micro_batch {b.micro_batch}, global_batch "
                f"{b.global_batch}, policy {b.policy})",
                f"set batch.micro_batch={b.global_batch} (= batch.global_batch) and "
                "batch.policy=fixed, or turn step_in_backward off",
            )
        )
    if r.optimizer.grad_clip > 0:
        problems.append(
            src.problem(
                ("optimizer", "grad_clip"),
                why + "the global gradient norm is known only after "
                "the first parameters were updated: it cannot clip them",
                "set optimizer.grad_clip=0",
            )
        )
    if r.hardware.world_size > 1:
        problems.append(
            src.problem(
                ("hardware", "gpus"),
                why + "the gradients are never reduced over processes",
                "run on one GPU, or turn step_in_backward off and use ZeRO",
            )
        )
    o = r.offload
    if o.zero_stage != 0 or o.optimizer != "none" or o.params != "none":
        problems.append(
            src.problem(
                ("offload", "zero_stage"),
                why + "the optimizer steps beside the weights on the "
                "GPU, outside DeepSpeed's ZeRO partitioning and offload",
                "set offload.zero_stage=0, offload.optimizer=none and offload.params=none "
                "(paged_adamw_8bit pages its states to the host instead)",
            )
        )
    if r.checkpointing.mlp_tiles != 0:
        problems.append(
            src.problem(
                ("checkpointing", "mlp_tiles"),
                why + "a tiled MLP, whose weight gradients are added up tile by tile, would be updated after its "
                "first tile with a part of its gradient (optimizer.step_in_backward)",
                "set checkpointing.mlp_tiles=0, or optimizer.step_in_backward=false",
            )
        )
    p = r.precision
    if p.mode != "cast" or (p.master != "bf16" and p.compute != "fp32"):  # fp32 weights are their own master too
        problems.append(
            src.problem(
                ("precision", "master"),
                why + "there is no separate master copy: the weights are updated in place in precision.compute",
                "set precision.master=bf16 and precision.mode=cast",
            )
        )
    return problems


@reads("train", "data", "offload")
def _check_eval_generate(loaded: LoadedRecipe) -> list[Problem]:
    r, src = loaded.recipe, loaded.sources
    if not r.train.eval_generate:
        return []
    held_out = r.data.validation if r.data.validation is not None else r.data.train
    if isinstance(held_out, str) or all(spec.type == "text" for spec in held_out):
        return [
            src.problem(
                ("train", "eval_generate"),
                "generation is scored against the answers of completion, "
                "instruction or chat data, and this recipe's held-out data is text only",
                "set train.eval_generate=0 (the validation loss still measures text), or add "
                "conversations to data.validation",
            )
        ]
    if r.zero_stage == 3:
        return [
            src.problem(
                ("train", "eval_generate"),
                "ZeRO-3 partitions the weights over the ranks, so rank 0 cannot generate alone during the run",
                "set train.eval_generate=0 and score the finished run with `memtrain eval RUN_DIR`",
            )
        ]
    return []


# The dataset types each objective trains on (schema.PAIR_TYPES are the preference objectives').
OBJECTIVE_TYPES = {
    "sft": ("text", "completion", "instruction", "chat"),
    "dpo": ("preference",),
    "orpo": ("preference",),
    "simpo": ("preference",),
    "kto": ("kto",),
}


@reads("train", "data")
def _check_objective_data(loaded: LoadedRecipe) -> list[Problem]:
    """Each dataset's type is one the objective trains on: a preference dataset has no single answer to train SFT on,
    and chat data has no rejected answer to prefer the chosen one over."""
    r, src = loaded.recipe, loaded.sources
    objective = r.train.objective
    wanted = OBJECTIVE_TYPES[objective]
    if objective == "sft":
        hint_of = {
            "preference": "set train.objective to dpo, orpo or simpo to train on the pairs, or use a completion or "
            "chat dataset",
            "kto": "set train.objective=kto to train on the labelled records, or use a completion or chat dataset",
        }
    else:
        said = " or ".join(f"type: {kind}" for kind in wanted)
        hint_of = {
            kind: f"train.objective={objective} trains on {said} datasets (a prompt with "
            + ("a chosen and a rejected answer" if objective != "kto" else "an answer and a true/false label")
            + "); give such data, or set train.objective to one that trains on this type"
            for kind in ("text", "completion", "instruction", "chat", "preference", "kto")
        }
    problems = []
    for key in ("train", "validation"):
        source = getattr(r.data, key)
        if source is None:
            continue
        if isinstance(source, str):
            if objective != "sft":
                problems.append(
                    src.problem(
                        ("data", key),
                        f"is a path, trained on as text, and train.objective={objective} trains on pairs",
                        hint_of["text"],
                    )
                )
            continue
        for i, spec in enumerate(source):
            if spec.type not in wanted:
                problems.append(
                    src.problem(
                        ("data", key, str(i), "type"),
                        f"a {spec.type} dataset cannot train train.objective={objective}",
                        hint_of[spec.type],
                    )
                )
    if objective != "sft":
        # which tokens are targets is the objective's: the answers of each pair (KTO: of each record)
        for name, value, default in (
            ("train_on_inputs", r.data.train_on_inputs, False),
            ("train_on", r.data.train_on, "all_turns"),
        ):
            if value != default:
                problems.append(
                    src.problem(
                        ("data", name),
                        f"is read only for SFT; train.objective={objective} trains on the answer after each prompt "
                        "(every assistant turn after the prompt), so it would do nothing",
                        f"remove data.{name}",
                    )
                )
    return problems


@reads("train", "model", "preference")
def _check_preference(loaded: LoadedRecipe) -> list[Problem]:
    """The preference section goes with a preference objective, each key with the objective that reads it, and the
    reference with what the objective and the model can have."""
    r, src = loaded.recipe, loaded.sources
    objective, p = r.train.objective, r.preference
    if p is None:
        return _reference_problems(loaded, objective, Preference())
    if objective == "sft":
        return [
            src.problem(
                ("preference",),
                "is read only by a preference objective, and train.objective is sft, so it would do nothing",
                "set train.objective to dpo, orpo, simpo or kto, or remove the preference section",
            )
        ]
    problems = []
    for name, objectives in PREFERENCE_KEYS.items():
        value = getattr(p, name)
        if objective not in objectives and value != Preference.model_fields[name].get_default():
            problems.append(
                src.problem(
                    ("preference", name),
                    f"is read only by train.objective {' and '.join(objectives)}, and this recipe's is {objective}, so "
                    "it would do nothing",
                    "remove the key, or set train.objective to the one it is for",
                )
            )
    if objective == "dpo" and p.loss_type == "ipo" and p.label_smoothing:
        problems.append(
            src.problem(
                ("preference", "label_smoothing"),
                "label smoothing is for DPO's sigmoid loss; IPO has none",
                "remove preference.label_smoothing, or set preference.loss_type=sigmoid",
            )
        )
    return problems + _reference_problems(loaded, objective, p)


def _reference_problems(loaded: LoadedRecipe, objective: str, p: Preference) -> list[Problem]:
    src, lora = loaded.sources, loaded.recipe.model.lora is not None
    at = ("preference", "reference")
    if objective in ("orpo", "simpo") and p.reference not in ("auto", "none"):
        return [
            src.problem(
                at,
                f"{objective} needs no reference model, so preference.reference={p.reference} would load or compute "
                "one for nothing",
                "remove preference.reference (auto), or set it to none",
            )
        ]
    if objective in ("dpo", "kto") and p.reference == "none":
        return [
            src.problem(
                at,
                f"{objective} measures the policy against a reference model, and preference.reference is none",
                "remove preference.reference (auto: adapters_off under LoRA, precomputed for a full fine-tune), or use "
                "train.objective orpo or simpo, which need no reference",
            )
        ]
    if objective in ("dpo", "kto") and p.reference == "adapters_off" and not lora:
        return [
            src.problem(
                at,
                "adapters_off uses the model with its LoRA adapters disabled as the reference, and this recipe has no "
                "model.lora",
                "set preference.reference=precomputed for a full fine-tune (or auto), or add model.lora",
            )
        ]
    return []
