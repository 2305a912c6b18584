"""The second validation phase: checks of a recipe against what lies outside it.

The recipe layer checks a recipe on its own (`memtrain.recipe.rules`). These need more: the user's
files (model and tokenizer directories, data files, the NVMe directory), the model's own config and
parameter count, and the installed packages. What they need from the machine arrives as data (an
`Environment`), so a test can ask "what if bitsandbytes were missing" without uninstalling it.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from memtrain.configs import model_preset, model_preset_names
from memtrain.data.read.corpus import BUILTIN_PREFIX, builtin_corpus_names, resolve_format
from memtrain.data.read.records import record_format, resolve_dataset_path
from memtrain.data.render.templates import needs_template, shipped_template_names
from memtrain.data.tokens.tokenizer import builtin_tokenizer_names, has_chat_template, tokenizer_directory
from memtrain.dtypes import DTYPE_BYTES
from memtrain.errors import DataError, Problem, UserError
from memtrain.hub import hub_repo, model_dir
from memtrain.model.config import model_architecture
from memtrain.paths import kind_of
from memtrain.plan.params import count_parameters
from memtrain.recipe.rules import Registry, gpu_profile_of
from memtrain.recipe.schema import Recipe
from memtrain.recipe.sources import COMMAND_LINE, LoadedRecipe
from memtrain.units import gib


@dataclass(frozen=True)
class Environment:
    """What the checks need to know about this machine."""

    bitsandbytes: bool = True  # whether bitsandbytes can be imported (model.quantize, 8-bit / paged optimizers)


def current_environment() -> Environment:
    """This machine, as the checks see it."""
    return Environment(bitsandbytes=importlib.util.find_spec("bitsandbytes") is not None)


CHECKS = Registry()
reads = CHECKS.reads


def check_environment(
    loaded: LoadedRecipe,
    env: Environment,
    skip_sections: set[str] | frozenset[str] = frozenset(),
    weights_fit: bool = True,
    packages: bool = True,
) -> list[Problem]:
    """Every problem of the recipe against files, models and packages (empty when none).

    weights_fit: False leaves out "the weights alone exceed the card", for `memtrain plan`, whose job
    is to say what to change when a recipe does not fit.
    packages: False leaves out the optional packages the run will import (bitsandbytes), for `plan` and
    `validate`, which one runs before installing anything, often on another machine than the GPU's
    (`packages_needed` says what the run will need).
    """
    leave_out = (() if weights_fit else (check_weights_fit,)) + (() if packages else (_check_bitsandbytes,))
    return CHECKS.run(loaded, env, skip_sections=skip_sections, leave_out=leave_out)


def model_config_dict(loaded: LoadedRecipe) -> dict | None:
    """The model's Hugging Face config as a dict (preset or the local directory's config.json), if readable."""
    model = loaded.recipe.model
    config = None
    if model.preset and model.preset in model_preset_names():
        config = model_preset(model.preset)
    elif model.path and not model.preset:
        try:
            path = model_dir(model.path, model.revision, need="config") / "config.json"
        except UserError:  # a Hub id that cannot be read: _check_model_files says why
            return None
        try:
            config = json.loads(path.read_text()) if path.is_file() else None
        except (OSError, UnicodeDecodeError, ValueError):
            return None
    return dict(config) if isinstance(config, dict) else None


@reads("model")
def _check_model_files(loaded: LoadedRecipe, env: Environment) -> list[Problem]:
    model, src = loaded.recipe.model, loaded.sources
    problems = []
    hub_config = None
    if hub_repo(model.path) and not model.preset:  # its config.json fetched now (plan and validate need no more)
        try:
            hub_config = model_dir(model.path, model.revision, need="config") / "config.json"
        except UserError as error:
            problems += loaded.sources.locate(error).problems
    elif model.path and not model.preset:
        path = Path(model.path)
        if not path.is_dir():
            problems.append(
                src.problem(
                    ("model", "path"),
                    f"model directory '{path}' does not exist",
                    "give a local Hugging Face model directory, or use model.preset; "
                    f"{relative_paths_start(loaded, ('model', 'path'))}",
                )
            )
        elif not (path / "config.json").is_file():
            problems.append(
                src.problem(
                    ("model", "path"),
                    f"'{path}' has no config.json",
                    "point model.path at a directory saved with save_pretrained",
                )
            )
    tokenizer = model.tokenizer
    if tokenizer and tokenizer.startswith(BUILTIN_PREFIX):
        if tokenizer[len(BUILTIN_PREFIX) :] not in builtin_tokenizer_names():
            problems.append(
                src.problem(
                    ("model", "tokenizer"),
                    f"no builtin tokenizer '{tokenizer}'",
                    "builtin tokenizers: " + ", ".join(BUILTIN_PREFIX + name for name in builtin_tokenizer_names()),
                )
            )
    elif tokenizer and not Path(tokenizer).is_dir():
        problems.append(
            src.problem(
                ("model", "tokenizer"),
                f"tokenizer directory '{tokenizer}' does not exist",
                "give a local directory, or 'builtin:shakespeare'; "
                f"{relative_paths_start(loaded, ('model', 'tokenizer'))}",
            )
        )
    has_config = (
        model.preset in model_preset_names()
        if model.preset
        else hub_config is not None
        if hub_repo(model.path)
        else bool(model.path) and (Path(model.path) / "config.json").is_file()
    )
    if not problems and has_config:
        try:  # an encoder, an encoder-decoder or a vision model: refused now, as plan and run refuse it
            model_architecture(model)
        except UserError as error:
            problems += src.locate(error).problems
    return problems


@reads("data")
def _check_template_name(loaded: LoadedRecipe, env: Environment) -> list[Problem]:
    template = loaded.recipe.data.template
    if template is None or template in shipped_template_names():
        return []
    return [
        loaded.sources.problem(
            ("data", "template"),
            f"there is no chat template '{template}'",
            "use one of " + ", ".join(shipped_template_names()) + ", or leave data.template "
            "out to use the tokenizer's own chat_template",
        )
    ]


@reads("data", "model")
def _check_chat_template(loaded: LoadedRecipe, env: Environment) -> list[Problem]:
    """Chat, instruction and completion data without data.template need the tokenizer's own chat template: said
    by validate too, not first by the command that tokenises. Read from its files, not loaded."""
    data, model = loaded.recipe.data, loaded.recipe.model
    if data.template is not None or not needs_template(data):
        return []
    try:
        directory, key = tokenizer_directory(model)
    except UserError:
        return []  # an unknown builtin: _check_model_files says so
    if has_chat_template(directory) is not False:
        return []  # it has one, or its files are missing or unreadable (said where the tokenizer is checked)
    return [
        loaded.sources.problem(
            ("data", "template"),
            f"the tokenizer ({key}: {directory}) has no chat_template, and completion, "
            "instruction and chat data need one",
            "set data.template to one of "
            + ", ".join(shipped_template_names())
            + " (builtin:shakespeare-chat is a tokenizer with a chatml chat_template)",
        )
    ]


@reads("data")
def _check_data_files(loaded: LoadedRecipe, env: Environment) -> list[Problem]:
    data, src = loaded.recipe.data, loaded.sources
    problems = []
    for key in ("train", "validation"):
        value = getattr(data, key)
        if value is None:
            continue
        if not isinstance(value, str):  # a list of datasets
            for index, spec in enumerate(value):
                problem = _dataset_path_problem(loaded, ("data", key, str(index), "path"), spec.path, spec.type)
                problems += [problem] if problem else []
            continue
        if value.startswith(BUILTIN_PREFIX):
            name = value[len(BUILTIN_PREFIX) :]
            if name not in builtin_corpus_names():
                problems.append(
                    src.problem(
                        ("data", key),
                        f"no builtin corpus '{name}'",
                        f"builtin corpora: {', '.join(builtin_corpus_names())}",
                    )
                )
        elif Path(value).is_dir():
            problems.append(
                src.problem(
                    ("data", key),
                    f"data file '{value}' is a directory, not a file",
                    "name a .txt or .jsonl file; a datasets directory goes in a list: [{path: DIR, type: text}]",
                )
            )
        elif (what := kind_of(value)) is not None:  # /dev/zero, a FIFO: read as data, never ends
            problems.append(
                src.problem(
                    ("data", key),
                    f"data file '{value}' is {what}, not a regular file",
                    "name a .txt or .jsonl file (a regular file, whole on disk)",
                )
            )
        elif not Path(value).is_file():
            problems.append(
                src.problem(
                    ("data", key),
                    f"data file '{value}' does not exist",
                    f"check the path; {relative_paths_start(loaded, ('data', key))}",
                )
            )
        else:
            try:  # the reader's own rule: a file of records (.json, .parquet, ...) is not read as text
                resolve_format(value, data.format)
            except DataError as error:
                problems += [src.problem(("data", key), p.message, p.hint) for p in error.problems]
    return problems


def _dataset_path_problem(loaded: LoadedRecipe, key: tuple[str, ...], path: str, kind: str) -> Problem | None:
    """What is wrong with a dataset's path (a builtin name that does not exist, a missing file, a file the
    readers cannot read as `kind`), or None."""
    try:
        resolved = resolve_dataset_path(path)
        exists = resolved.exists()
        what = kind_of(resolved)
        if what is not None and what != "a directory":  # a datasets directory is an input; /dev/zero, a FIFO are not
            return loaded.sources.problem(
                key,
                f"dataset '{path}' is {what}, not a regular file",
                "give a .jsonl, .json, .parquet or .txt file or a datasets directory",
            )
        if exists:
            if record_format(path) == "text" and kind != "text":
                return loaded.sources.problem(
                    key,
                    f"'{path}' is plain text, which holds no {kind} records",
                    "give a .jsonl, .json or .parquet file or a datasets directory, or set the dataset's type: text",
                )
            return None
    except UserError as error:  # an unknown builtin or an unknown format: the reader's own message says which
        return loaded.sources.problem(key, error.problems[0].message, error.problems[0].hint)
    return loaded.sources.problem(
        key,
        f"dataset '{path}' does not exist",
        f"give a .jsonl, .json, .parquet or .txt file or a datasets directory; {relative_paths_start(loaded, key)}",
    )


def relative_paths_start(loaded: LoadedRecipe, key: tuple[str, ...]) -> str:
    """Where a relative input path at `key` was looked for, as `memtrain.recipe.load.resolve_input_paths` decides:
    written in a recipe file, at that file's directory; typed on the command line (or in recipe text that has no
    file), at the directory memtrain runs in."""
    file, _ = loaded.sources.where(key)
    if file == COMMAND_LINE:
        return f"a relative path given on the command line starts at the directory memtrain runs in ({Path.cwd()})"
    if not Path(file).is_file():
        return f"a relative path starts at the directory memtrain runs in ({Path.cwd()})"
    return (
        "a relative path in a recipe starts at the directory of the recipe file that names it "
        f"({Path(file).resolve().parent})"
    )


@reads("data", "model")
def _check_seq_len(loaded: LoadedRecipe, env: Environment) -> list[Problem]:
    config = model_config_dict(loaded) or {}
    max_positions = config.get("max_position_embeddings")
    seq_len = loaded.recipe.data.seq_len
    if isinstance(max_positions, int) and seq_len > max_positions:
        return [
            loaded.sources.problem(
                ("data", "seq_len"),
                f"{seq_len} tokens is beyond the model's {max_positions} positions",
                f"set data.seq_len to at most {max_positions}",
            )
        ]
    return []


@reads("hardware", "offload")
def _check_nvme_writable(loaded: LoadedRecipe, env: Environment) -> list[Problem]:
    r, src = loaded.recipe, loaded.sources
    if "nvme" not in (r.offload.optimizer, r.offload.params) or not r.hardware.nvme_path:
        return []
    nvme = Path(r.hardware.nvme_path)
    probe = nvme if nvme.exists() else next((p for p in nvme.parents if p.exists()), None)
    if probe is None or not probe.is_dir() or not os.access(probe, os.W_OK):
        return [
            src.problem(
                ("hardware", "nvme_path"),
                f"'{nvme}' is not a writable directory",
                "choose a directory you can write to on a local disk",
            )
        ]
    return []


@reads("hardware", "precision", "offload", "model")
def check_weights_fit(loaded: LoadedRecipe, env: Environment) -> list[Problem]:
    r = loaded.recipe
    profile = gpu_profile_of(loaded)
    if profile is None or r.offload.params != "none":
        return []
    try:
        counts = count_parameters(r.model)
    except Exception:  # noqa: BLE001 — a model that cannot be built is reported by the model checks
        return []
    bytes_per_param = DTYPE_BYTES[r.precision.compute]
    # the base weights: LoRA adapters are small and come later; quantised layers at their packed size
    weights_bytes = counts.weight_bytes(bytes_per_param) - (counts.trainable * bytes_per_param if r.model.lora else 0)
    stored_as = f"{r.model.quant_type} + {r.precision.compute}" if counts.quantized else r.precision.compute
    # ZeRO-3 shards the weights over the GPUs of every node; stages 0-2 keep a whole copy on each
    weights_per_gpu_bytes = weights_bytes / r.hardware.world_size if r.zero_stage == 3 else weights_bytes
    if weights_per_gpu_bytes <= profile.memory_bytes:
        return []
    return [
        loaded.sources.problem(
            ("hardware", "gpu"),
            f"the model's weights alone ({gib(weights_per_gpu_bytes):.1f} GiB per GPU in {stored_as}) "
            f"exceed the {profile.name} ({gib(profile.memory_bytes):.0f} GiB)",
            "offload parameters (offload.params=cpu), LoRA on quantised weights (model.quantize.type=nf4), "
            "or a larger card; "
            "`memtrain plan --fit` finds a fit",
        )
    ]


def packages_needed(recipe: Recipe, env: Environment) -> list[str]:
    """The optional packages a run of `recipe` imports that this machine lacks, each with what needs it."""
    if env.bitsandbytes:
        return []
    users = [
        name
        for name, uses in (
            ("model.quantize", recipe.model.quant_type is not None),
            (f"optimizer.name={recipe.optimizer.name}", recipe.optimizer.name != "adamw"),
        )
        if uses
    ]
    return [f"bitsandbytes (for {' and '.join(users)}; pip install 'memtrain[qlora]')"] if users else []


@reads("model", "optimizer")
def _check_bitsandbytes(loaded: LoadedRecipe, env: Environment) -> list[Problem]:
    r, src = loaded.recipe, loaded.sources
    if env.bitsandbytes:
        return []
    problems = []
    if r.model.quant_type is not None:
        problems.append(
            src.problem(
                ("model", "quantize"),
                "model.quantize needs bitsandbytes, which is not installed",
                "pip install 'memtrain[qlora]'",
            )
        )
    if r.optimizer.name != "adamw":
        problems.append(
            src.problem(
                ("optimizer", "name"),
                f"{r.optimizer.name} needs bitsandbytes, which is not installed",
                "pip install 'memtrain[qlora]', or optimizer.name=adamw",
            )
        )
    return problems
