"""Rules that relate several parts of a recipe, all collected into one list of problems.

Field-level rules live in the schema; these are the contradictions between fields, and the
checks against the files and hardware the recipe names. Each check declares the sections it reads,
so that when one section failed validation the checks of the other sections still run.
"""
from __future__ import annotations

import difflib
import importlib.util
import json
import os
from pathlib import Path
from typing import Callable

from memtrain.configs import gpu_profile, model_preset, model_preset_names
from memtrain.errors import Problem
from memtrain.recipe.load import LoadedRecipe
from memtrain.units import gib

BUILTIN_PREFIX = "builtin:"

Check = Callable[[LoadedRecipe], list[Problem]]
CHECKS: list[tuple[Check, frozenset[str]]] = []


def reads(*sections: str) -> Callable[[Check], Check]:
    """Register a check with the recipe sections it reads."""

    def register(check: Check) -> Check:
        CHECKS.append((check, frozenset(sections)))
        return check

    return register


def check_recipe(loaded: LoadedRecipe, skip_sections: set[str] | frozenset[str] = frozenset()) -> list[Problem]:
    """Every cross-field problem of a recipe (empty when consistent).

    Checks that read a section named in `skip_sections` (one that failed validation) are skipped.
    """
    problems: list[Problem] = []
    for check, sections in CHECKS:
        if not sections & set(skip_sections):
            problems.extend(check(loaded))
    return problems


def model_config_dict(loaded: LoadedRecipe) -> dict | None:
    """The model's Hugging Face config as a dict (preset or the local directory's config.json), if readable."""
    model = loaded.recipe.model
    config = None
    if model.preset and model.preset in model_preset_names():
        config = model_preset(model.preset)
    elif model.path and not model.preset:
        path = Path(model.path) / "config.json"
        try:
            config = json.loads(path.read_text()) if path.is_file() else None
        except (OSError, UnicodeDecodeError, ValueError):
            return None
    return dict(config) if isinstance(config, dict) else None


def approx_param_count(config: dict) -> int | None:
    """Parameters of a Llama-family decoder from its config (exact for Llama); None if the config lacks a field."""
    try:
        hidden = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        inter = int(config["intermediate_size"])
        vocab = int(config["vocab_size"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    mlp = 3 * hidden * inter
    per_layer = attention + mlp + 2 * hidden
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return layers * per_layer + embeddings + hidden


def _approx_linear_params(config: dict) -> int | None:
    """Weights of a Llama-family decoder's attention and MLP projections (what quantisation packs)."""
    try:
        hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        inter = int(config["intermediate_size"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return layers * (hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2 + 3 * hidden * inter)


def _has_bitsandbytes() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


def _profile(loaded: LoadedRecipe):
    try:
        return gpu_profile(loaded.recipe.hardware.gpu)
    except (ValueError, KeyError, TypeError, OSError):
        return None


@reads("model")
def _check_model(loaded: LoadedRecipe) -> list[Problem]:
    model, src = loaded.recipe.model, loaded.sources
    problems = []
    if bool(model.preset) == bool(model.path):
        if model.preset:
            return [src.problem(("model",), "give exactly one of model.preset or model.path, not both",
                                "remove model.path to use the preset, or model.preset to train the local model")]
        return [src.problem(("model",), "say what to train: model.preset or model.path",
                            f"presets: {', '.join(model_preset_names())}; or a local Hugging Face directory")]
    if model.preset and model.preset not in model_preset_names():
        close = difflib.get_close_matches(model.preset, model_preset_names(), n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"presets: {', '.join(model_preset_names())}"
        problems.append(src.problem(("model", "preset"), f"unknown model preset '{model.preset}'", hint))
    if model.path:
        path = Path(model.path)
        if not path.is_dir():
            problems.append(src.problem(("model", "path"), f"model directory '{path}' does not exist",
                                        "give a local Hugging Face model directory, or use model.preset"))
        elif not (path / "config.json").is_file():
            problems.append(src.problem(("model", "path"), f"'{path}' has no config.json",
                                        "point model.path at a directory saved with save_pretrained"))
    tokenizer = model.tokenizer
    if tokenizer and not tokenizer.startswith(BUILTIN_PREFIX) and not Path(tokenizer).is_dir():
        problems.append(src.problem(("model", "tokenizer"), f"tokenizer directory '{tokenizer}' does not exist",
                                    "give a local directory, or 'builtin:shakespeare'"))
    return problems


@reads("data")
def _check_data_files(loaded: LoadedRecipe) -> list[Problem]:
    from memtrain.data.corpus import builtin_corpus_names

    data, src = loaded.recipe.data, loaded.sources
    problems = []
    for key in ("train", "validation"):
        value = getattr(data, key)
        if value is None:
            continue
        if value.startswith(BUILTIN_PREFIX):
            name = value[len(BUILTIN_PREFIX):]
            if name not in builtin_corpus_names():
                problems.append(src.problem(("data", key), f"no builtin corpus '{name}'",
                                            f"builtin corpora: {', '.join(builtin_corpus_names())}"))
        elif not Path(value).is_file():
            problems.append(src.problem(("data", key), f"data file '{value}' does not exist",
                                        "paths are relative to the directory you run memtrain from"))
    return problems


@reads("data", "model")
def _check_seq_len(loaded: LoadedRecipe) -> list[Problem]:
    config = model_config_dict(loaded) or {}
    max_positions = config.get("max_position_embeddings")
    seq_len = loaded.recipe.data.seq_len
    if isinstance(max_positions, int) and seq_len > max_positions:
        return [loaded.sources.problem(("data", "seq_len"),
                                       f"{seq_len} tokens is beyond the model's {max_positions} positions",
                                       f"set data.seq_len to at most {max_positions}")]
    return []


@reads("hardware", "offload")
def _check_nvme(loaded: LoadedRecipe) -> list[Problem]:
    r, src = loaded.recipe, loaded.sources
    if "nvme" not in (r.offload.optimizer, r.offload.params):
        return []
    tier = ("offload", "optimizer") if r.offload.optimizer == "nvme" else ("offload", "params")
    if not r.hardware.nvme_path:
        # point at the line that asks for NVMe when the recipe has no nvme_path line to point at
        at = ("hardware", "nvme_path") if ("hardware", "nvme_path") in src.origin else tier
        return [src.problem(at, f"{'.'.join(tier)}=nvme needs hardware.nvme_path",
                            f"set hardware.nvme_path to a directory on a fast local disk, or change {'.'.join(tier)}")]
    nvme = Path(r.hardware.nvme_path)
    probe = nvme if nvme.exists() else next((p for p in nvme.parents if p.exists()), None)
    if probe is None or not probe.is_dir() or not os.access(probe, os.W_OK):
        return [src.problem(("hardware", "nvme_path"), f"'{nvme}' is not a writable directory",
                            "choose a directory you can write to on a local disk")]
    return []


@reads("hardware", "precision")
def _check_bf16_support(loaded: LoadedRecipe) -> list[Problem]:
    profile = _profile(loaded)
    if profile is not None and loaded.recipe.precision.compute == "bf16" and not profile.bf16:
        return [loaded.sources.problem(("precision", "compute"), f"{profile.name} has no bf16 support",
                                       "use precision.compute=fp16 with precision.loss_scale")]
    return []


@reads("hardware", "precision", "offload", "model")
def _check_weights_fit(loaded: LoadedRecipe) -> list[Problem]:
    r = loaded.recipe
    profile, config = _profile(loaded), model_config_dict(loaded)
    params = approx_param_count(config) if config else None
    if profile is None or params is None or r.offload.params != "none":
        return []
    bytes_per_param = 4 if r.precision.compute == "fp32" else 2
    weights_bytes = params * bytes_per_param
    linear = _approx_linear_params(config) if r.model.quant_type else None
    if linear:
        from memtrain.plan.quantized import quantized_weight_bytes

        weights_bytes = (params - linear) * bytes_per_param + quantized_weight_bytes(
            linear, 0, r.model.quant_type, r.model.quantize.double_quant)
    stored_as = f"{r.model.quant_type} + {r.precision.compute}" if linear else r.precision.compute
    # ZeRO-3 shards the weights over the GPUs; stages 0-2 keep a whole copy on each
    weights_per_gpu_bytes = weights_bytes / r.hardware.gpus if r.offload.stage == 3 else weights_bytes
    if weights_per_gpu_bytes <= profile.memory_bytes:
        return []
    return [loaded.sources.problem(
        ("hardware", "gpu"),
        f"the model's weights alone ({gib(weights_per_gpu_bytes):.1f} GiB per GPU in {stored_as}) "
        f"exceed the {profile.name} ({gib(profile.memory_bytes):.0f} GiB)",
        "offload parameters (offload.params=cpu), LoRA on quantised weights (model.quantize.type=nf4), "
        "or a larger card; "
        "`memtrain plan --fit` finds a fit",
    )]


@reads("offload", "precision")
def _check_offload(loaded: LoadedRecipe) -> list[Problem]:
    o, src = loaded.recipe.offload, loaded.sources
    problems = []
    if o.params != "none" and o.zero_stage not in ("auto", 3):
        problems.append(src.problem(("offload", "zero_stage"),
                                    f"offload.params={o.params} needs ZeRO stage 3, not {o.zero_stage}",
                                    "set offload.zero_stage=3 (or auto)"))
    if o.optimizer != "none" and o.zero_stage == 0:
        problems.append(src.problem(("offload", "zero_stage"),
                                    f"offload.optimizer={o.optimizer} needs ZeRO stage 1, 2 or 3, not 0",
                                    "set offload.zero_stage=auto"))
    if o.optimizer == "nvme" and loaded.recipe.precision.master == "bf16":
        # DeepSpeed 0.19's optimizer swapper sizes its pinned buffers in the master dtype but swaps fp32 tensors
        # through them: the first optimizer step stops on an assertion
        problems.append(src.problem(("precision", "master"), "bf16 master weights cannot go to NVMe: DeepSpeed's "
                                    "optimizer swapper stops at the first step with them",
                                    "set precision.master=fp32, or offload.optimizer=cpu"))
    if o.params == "nvme" and o.optimizer == "none":
        problems.append(src.problem(("offload", "optimizer"), "parameters on NVMe need the optimizer offloaded too",
                                    "set offload.optimizer=cpu or nvme"))
    if o.ratio < 1.0:
        if o.optimizer != "cpu":
            problems.append(src.problem(("offload", "ratio"),
                                        f"a partial offload ratio works only with offload.optimizer=cpu, not {o.optimizer}",
                                        "remove offload.ratio or set offload.optimizer=cpu"))
        elif loaded.recipe.offload.stage != 3:
            problems.append(src.problem(("offload", "ratio"), "DeepSpeed's partial optimizer offload needs ZeRO stage 3",
                                        "set offload.zero_stage=3 or remove offload.ratio"))
    return problems


@reads("offload")
def _check_zenflow(loaded: LoadedRecipe) -> list[Problem]:
    # DeepSpeed's ZenFlow at ZeRO-1/2 flattens every weight matrix transposed but hands the model views of the
    # original shape, so after deepspeed.initialize each matrix holds its own transpose, reshaped (0.19.8;
    # tests/test_policies_deepspeed.py shows it and fails once DeepSpeed lays the weights out right)
    if not loaded.recipe.offload.zenflow:
        return []
    return [loaded.sources.problem(("offload", "zenflow"), "DeepSpeed's ZenFlow replaces every weight matrix with its "
                                   "own transpose, reshaped, inside deepspeed.initialize: the run would fine-tune "
                                   "scrambled weights", "remove offload.zenflow (plain ZeRO-Offload is the same "
                                   "recipe without it)")]


@reads("precision")
def _check_precision(loaded: LoadedRecipe) -> list[Problem]:
    p, src = loaded.recipe.precision, loaded.sources
    problems = []
    if p.loss_scale is not None and p.compute != "fp16":
        problems.append(src.problem(("precision", "loss_scale"), f"loss scaling is for fp16, but compute is {p.compute}",
                                    "remove precision.loss_scale, or set precision.compute=fp16"))
    if p.mode == "autocast" and p.compute != "bf16":
        problems.append(src.problem(("precision", "mode"), f"autocast runs matmuls in bf16, but compute is {p.compute}",
                                    "set precision.compute=bf16, or precision.mode=cast"))
    if p.mode == "autocast" and p.master == "bf16":
        problems.append(src.problem(("precision", "master"), "autocast keeps fp32 weights; bf16 master weights "
                                    "do not apply", "set precision.master=fp32"))
    if p.master == "bf16" and p.compute != "bf16":
        problems.append(src.problem(("precision", "master"), f"bf16 master weights need compute bf16, not {p.compute}",
                                    "set precision.master=fp32"))
    return problems


@reads("batch", "hardware")
def _check_batch_split(loaded: LoadedRecipe) -> list[Problem]:
    b, gpus, src = loaded.recipe.batch, loaded.recipe.hardware.gpus, loaded.sources
    # one problem per recipe: the first of these that holds explains the others
    if isinstance(b.micro_batch, int) and b.micro_batch * gpus > b.global_batch:
        return [src.problem(("batch", "micro_batch"),
                            f"gpus × micro_batch = {gpus} × {b.micro_batch} exceeds the global batch {b.global_batch}",
                            f"lower batch.micro_batch to at most {max(1, b.global_batch // gpus)}")]
    if isinstance(b.micro_batch, int) and b.global_batch % (b.micro_batch * gpus):
        return [src.problem(("batch", "global_batch"),
                            f"global batch {b.global_batch} is not divisible by gpus × micro_batch = {gpus} × {b.micro_batch}",
                            f"use a global batch that is a multiple of {b.micro_batch * gpus}")]
    if b.global_batch % gpus:
        return [src.problem(("batch", "global_batch"), f"global batch {b.global_batch} cannot be split over {gpus} GPUs",
                            f"use a multiple of {gpus}")]
    return []


@reads("batch")
def _check_adaptive(loaded: LoadedRecipe) -> list[Problem]:
    a, src = loaded.recipe.batch.adaptive, loaded.sources
    problems = []
    if a.min_micro_batch > a.max_micro_batch:
        problems.append(src.problem(("batch", "adaptive", "min_micro_batch"),
                                    f"min_micro_batch {a.min_micro_batch} exceeds max_micro_batch {a.max_micro_batch}",
                                    "lower min_micro_batch or raise max_micro_batch"))
    if a.grow_below >= a.shrink_above:
        problems.append(src.problem(("batch", "adaptive", "grow_below"),
                                    f"grow_below {a.grow_below} must be below shrink_above {a.shrink_above}",
                                    "the defaults are 0.70 and 0.90"))
    return problems


@reads("train")
def _check_length(loaded: LoadedRecipe) -> list[Problem]:
    t, src = loaded.recipe.train, loaded.sources
    if t.steps is None and t.epochs is None:
        return [src.problem(("train",), "say how long to train: train.steps or train.epochs",
                            "for example train.steps=1000")]
    if t.steps is not None and t.epochs is not None:
        return [src.problem(("train", "epochs"), "give train.steps or train.epochs, not both",
                            "remove one of them")]
    return []


@reads("train", "schedule")
def _check_warmup(loaded: LoadedRecipe) -> list[Problem]:
    r, src = loaded.recipe, loaded.sources
    if r.train.steps is not None and r.schedule.warmup_steps > r.train.steps:
        return [src.problem(("schedule", "warmup_steps"),
                            f"warmup of {r.schedule.warmup_steps} steps is longer than the whole run ({r.train.steps})",
                            f"use at most {r.train.steps} warmup steps")]
    return []


def compile_unsupported(r) -> tuple[str, str] | None:
    """(what is wrong, what to do) when this recipe's layers cannot be compiled (train.compile), else None."""
    if r.offload.stage == 3:
        return ("train.compile works with ZeRO stage 0-2; ZeRO-3 gathers each layer's weights in hooks that "
                "torch.compile would have to trace through",
                "set train.compile=false, or offload.params=none and offload.zero_stage=2")
    if "offload" in r.checkpointing.rules.values():
        return ("train.compile cannot be combined with activation offload rules (their saved-tensor hooks do "
                "not run inside compiled layers)",
                "set train.compile=false, or use recompute instead of offload in checkpointing.rules")
    return None


@reads("train", "offload", "checkpointing")
def _check_compile(loaded: LoadedRecipe) -> list[Problem]:
    unsupported = compile_unsupported(loaded.recipe) if loaded.recipe.train.compile else None
    return [loaded.sources.problem(("train", "compile"), *unsupported)] if unsupported else []


@reads("checkpointing")
def _check_checkpointing(loaded: LoadedRecipe) -> list[Problem]:
    c, src = loaded.recipe.checkpointing, loaded.sources
    problems = []
    if c.strategy == "rules" and not c.rules:
        problems.append(src.problem(("checkpointing", "rules"), "strategy 'rules' needs at least one rule",
                                    "for example {'model.layers.*.mlp': recompute}"))
    if c.rules and c.strategy != "rules":
        problems.append(src.problem(("checkpointing", "strategy"), f"rules are given but strategy is '{c.strategy}'",
                                    "set checkpointing.strategy=rules, or remove the rules"))
    if c.strategy == "rules":
        from memtrain.model.checkpointing import rule_problems

        for pattern, message in rule_problems(c.rules):
            problems.append(src.problem(("checkpointing", "rules", pattern), message,
                                        "cut at whole blocks: *.self_attn, *.mlp or a whole layer"))
    return problems


@reads("model", "offload", "precision")
def _check_quantize(loaded: LoadedRecipe) -> list[Problem]:
    r, src = loaded.recipe, loaded.sources
    kind = r.model.quant_type
    if kind is None:
        return []
    problems = []
    if r.model.lora is None:
        problems.append(src.problem(("model", "quantize"), f"{kind} base weights are frozen, so nothing would train "
                                    "without LoRA adapters",
                                    "add model.lora (for example model.lora.r=16), or remove model.quantize"))
    if r.offload.stage == 3:
        at = ("offload", "params") if r.offload.params != "none" else ("offload", "zero_stage")
        problems.append(src.problem(
            at, f"{kind} weights cannot go through ZeRO-3, which partitions and offloads parameters as flat "
            "floating-point tensors: bitsandbytes packs them into integers whose quantisation constants live "
            "beside the tensor, where ZeRO-3 neither partitions nor gathers them",
            "set offload.params=none and offload.zero_stage=auto (ZeRO-2); quantised weights are a quarter "
            "of their bf16 size, which is what makes them fit"))
    if r.precision.mode == "autocast":
        problems.append(src.problem(("precision", "mode"), "autocast stores weights in fp32, but quantised layers "
                                    "already compute in precision.compute from their packed weights",
                                    "set precision.mode=cast with model.quantize"))
    if not _has_bitsandbytes():
        problems.append(src.problem(("model", "quantize"), "model.quantize needs bitsandbytes, which is not installed",
                                    "pip install 'memtrain[qlora]'"))
    return problems


@reads("optimizer", "offload")
def _check_client_optimizer(loaded: LoadedRecipe) -> list[Problem]:
    r, src = loaded.recipe, loaded.sources
    name = r.optimizer.name
    if name == "adamw":
        return []
    problems = []
    if r.offload.optimizer != "none":
        problems.append(src.problem(
            ("optimizer", "name"), f"{name} is bitsandbytes' optimizer, which steps on the device that holds the "
            f"parameters; with offload.optimizer={r.offload.optimizer} DeepSpeed steps its own CPU Adam on the host "
            "and refuses any other optimizer",
            f"set offload.optimizer=none to use {name}, or optimizer.name=adamw to offload"))
    if not _has_bitsandbytes():
        problems.append(src.problem(("optimizer", "name"), f"{name} needs bitsandbytes, which is not installed",
                                    "pip install 'memtrain[qlora]', or optimizer.name=adamw"))
    return problems
