"""Rules that relate several parts of a recipe, all collected into one list of problems.

Field-level rules live in the schema; these are the contradictions between fields, and the
checks against the files and hardware the recipe names.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from memtrain.configs import gpu_profile, gpu_profile_names, model_preset, model_preset_names
from memtrain.errors import Problem
from memtrain.recipe.load import LoadedRecipe
from memtrain.recipe.units import gib

BUILTIN_PREFIX = "builtin:"


def model_config_dict(loaded: LoadedRecipe) -> dict | None:
    """The model's Hugging Face config as a dict (preset or the local directory's config.json)."""
    model = loaded.recipe.model
    if model.preset:
        try:
            return dict(model_preset(model.preset))
        except KeyError:
            return None
    if model.path:
        config = Path(model.path) / "config.json"
        if config.is_file():
            try:
                return json.loads(config.read_text())
            except (OSError, json.JSONDecodeError):
                return None
    return None


def approx_param_count(config: dict) -> int:
    """Parameters of a Llama-family decoder from its config (exact for Llama; used for quick checks)."""
    hidden = config["hidden_size"]
    layers = config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    vocab = config["vocab_size"]
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    mlp = 3 * hidden * inter
    per_layer = attention + mlp + 2 * hidden
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return layers * per_layer + embeddings + hidden


def _check_model(loaded: LoadedRecipe) -> list[Problem]:
    model, src = loaded.recipe.model, loaded.sources
    problems = []
    if bool(model.preset) == bool(model.path):
        problems.append(src.problem(("model",), "give exactly one of model.preset or model.path",
                                    f"presets: {', '.join(model_preset_names())}"))
        return problems
    if model.preset and model.preset not in model_preset_names():
        import difflib

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


def _check_data(loaded: LoadedRecipe) -> list[Problem]:
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
    config = model_config_dict(loaded)
    if config:
        max_positions = config.get("max_position_embeddings")
        if max_positions and data.seq_len > max_positions:
            problems.append(src.problem(("data", "seq_len"),
                                        f"{data.seq_len} tokens is beyond the model's {max_positions} positions",
                                        f"set data.seq_len to at most {max_positions}"))
    return problems


def _check_hardware(loaded: LoadedRecipe) -> list[Problem]:
    r, src = loaded.recipe, loaded.sources
    problems = []
    try:
        profile = gpu_profile(r.hardware.gpu)
    except ValueError:
        problems.append(src.problem(("hardware", "gpu"), f"'{r.hardware.gpu}' is neither a GPU profile nor a size",
                                    f"profiles: {', '.join(gpu_profile_names())}; or a size such as '24GiB'"))
        profile = None
    uses_nvme = "nvme" in (r.offload.optimizer, r.offload.params)
    if uses_nvme and not r.hardware.nvme_path:
        problems.append(src.problem(("hardware", "nvme_path"), "an NVMe offload tier needs hardware.nvme_path",
                                    "set hardware.nvme_path to a directory on a fast local disk"))
    if r.hardware.nvme_path and uses_nvme:
        nvme = Path(r.hardware.nvme_path)
        probe = nvme if nvme.exists() else next((p for p in nvme.parents if p.exists()), None)
        if probe is None or not probe.is_dir() or not os.access(probe, os.W_OK):
            problems.append(src.problem(("hardware", "nvme_path"), f"'{nvme}' is not a writable directory",
                                        "choose a directory you can write to on a local disk"))
    if profile is not None and r.precision.compute == "bf16" and not profile.bf16:
        problems.append(src.problem(("precision", "compute"), f"{profile.name} has no bf16 support",
                                    "use precision.compute=fp16 with loss scaling"))
    config = model_config_dict(loaded)
    if profile is not None and config and "hidden_size" in config:
        bytes_per_param = 4 if r.precision.compute == "fp32" else 2
        weights = approx_param_count(config) * bytes_per_param
        weights_per_gpu = weights / r.hardware.gpus if _stage(r) == 3 else weights
        if r.offload.params == "none" and weights_per_gpu > profile.memory_bytes:
            problems.append(src.problem(
                ("hardware", "gpu"),
                f"the model's weights alone ({gib(weights):.1f} GiB in {r.precision.compute}) exceed "
                f"{profile.name} ({gib(profile.memory_bytes):.0f} GiB)",
                "offload parameters (offload.params=cpu) or choose a larger card; `memtrain plan --fit` finds a fit",
            ))
    return problems


def _stage(r) -> int:
    if r.offload.zero_stage != "auto":
        return int(r.offload.zero_stage)
    return 3 if r.offload.params != "none" else 2


def _check_offload(loaded: LoadedRecipe) -> list[Problem]:
    r, src = loaded.recipe, loaded.sources
    problems = []
    stage = r.offload.zero_stage
    if r.offload.params != "none" and stage not in ("auto", 3):
        problems.append(src.problem(("offload", "zero_stage"),
                                    f"parameter offload needs ZeRO stage 3, not {stage}",
                                    "set offload.zero_stage=3 (or auto)"))
    if r.offload.optimizer != "none" and stage == 0:
        problems.append(src.problem(("offload", "zero_stage"), "optimizer offload needs ZeRO stage 1, 2 or 3",
                                    "set offload.zero_stage=auto"))
    if r.offload.params == "nvme" and r.offload.optimizer == "none":
        problems.append(src.problem(("offload", "optimizer"), "parameters on NVMe need the optimizer offloaded too",
                                    "set offload.optimizer=cpu or nvme"))
    if r.offload.ratio < 1.0 and r.offload.optimizer != "cpu":
        problems.append(src.problem(("offload", "ratio"), "a partial offload ratio works only with offload.optimizer=cpu",
                                    "remove offload.ratio or set offload.optimizer=cpu"))
    if r.offload.ratio < 1.0 and _stage(r) != 3:
        problems.append(src.problem(("offload", "ratio"), "DeepSpeed's partial optimizer offload needs ZeRO stage 3",
                                    "set offload.zero_stage=3 or remove offload.ratio"))
    return problems


def _check_precision(loaded: LoadedRecipe) -> list[Problem]:
    p, src = loaded.recipe.precision, loaded.sources
    problems = []
    if p.loss_scale is not None and p.compute != "fp16":
        problems.append(src.problem(("precision", "loss_scale"), f"loss scaling is for fp16, but compute is {p.compute}",
                                    "remove precision.loss_scale, or set precision.compute=fp16"))
    if p.master == "bf16" and p.compute != "bf16":
        problems.append(src.problem(("precision", "master"), "bf16 master weights need precision.compute=bf16",
                                    "set precision.master=fp32"))
    return problems


def _check_batch(loaded: LoadedRecipe) -> list[Problem]:
    r, src = loaded.recipe, loaded.sources
    b = r.batch
    problems = []
    gpus = r.hardware.gpus
    if isinstance(b.micro_batch, int) and b.global_batch % (b.micro_batch * gpus):
        problems.append(src.problem(
            ("batch", "global_batch"),
            f"global batch {b.global_batch} is not divisible by gpus × micro_batch = {gpus} × {b.micro_batch}",
            f"use a global batch that is a multiple of {b.micro_batch * gpus}",
        ))
    if b.global_batch % gpus:
        problems.append(src.problem(("batch", "global_batch"),
                                    f"global batch {b.global_batch} cannot be split over {gpus} GPUs",
                                    f"use a multiple of {gpus}"))
    if isinstance(b.micro_batch, int) and b.micro_batch * gpus > b.global_batch:
        problems.append(src.problem(("batch", "micro_batch"), "micro_batch × gpus exceeds the global batch",
                                    "lower batch.micro_batch"))
    a = b.adaptive
    if a.min_micro_batch > a.max_micro_batch:
        problems.append(src.problem(("batch", "adaptive", "min_micro_batch"), "min_micro_batch exceeds max_micro_batch"))
    if a.grow_below >= a.shrink_above:
        problems.append(src.problem(("batch", "adaptive", "grow_below"), "grow_below must be below shrink_above",
                                    "the defaults are 0.70 and 0.90"))
    return problems


def _check_train(loaded: LoadedRecipe) -> list[Problem]:
    r, src = loaded.recipe, loaded.sources
    problems = []
    if r.train.steps is None and r.train.epochs is None:
        problems.append(src.problem(("train",), "say how long to train: train.steps or train.epochs",
                                    "for example train.steps=1000"))
    if r.train.steps is not None and r.train.epochs is not None:
        problems.append(src.problem(("train", "epochs"), "give train.steps or train.epochs, not both"))
    if r.train.steps is not None and r.schedule.warmup_steps > r.train.steps:
        problems.append(src.problem(("schedule", "warmup_steps"), "warmup is longer than the whole run",
                                    f"use at most {r.train.steps} warmup steps"))
    return problems


def _check_checkpointing(loaded: LoadedRecipe) -> list[Problem]:
    c, src = loaded.recipe.checkpointing, loaded.sources
    problems = []
    if c.strategy == "rules" and not c.rules:
        problems.append(src.problem(("checkpointing", "rules"), "strategy 'rules' needs at least one rule",
                                    "for example {'model.layers.*.mlp': recompute}"))
    if c.rules and c.strategy != "rules":
        problems.append(src.problem(("checkpointing", "strategy"), f"rules are given but strategy is '{c.strategy}'",
                                    "set checkpointing.strategy=rules"))
    if c.strategy == "rules":
        from memtrain.model.checkpointing import rule_problems

        for pattern, message in rule_problems(c.rules):
            problems.append(src.problem(("checkpointing", "rules", pattern), message,
                                        "cut at whole blocks: *.self_attn, *.mlp or a whole layer"))
    return problems


CHECKS = (_check_model, _check_data, _check_hardware, _check_offload, _check_precision, _check_batch,
          _check_train, _check_checkpointing)


def check_recipe(loaded: LoadedRecipe) -> list[Problem]:
    """Every cross-field problem of a validated recipe (an empty list when it is consistent)."""
    problems: list[Problem] = []
    for check in CHECKS:
        problems.extend(check(loaded))
    return problems
