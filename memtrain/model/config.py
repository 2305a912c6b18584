"""The model's Hugging Face config, from a shape preset or a local directory, without weights."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from memtrain.configs import model_preset
from memtrain.errors import Problem, UserError
from memtrain.hub import model_dir
from memtrain.model.architecture import Architecture, architecture
from memtrain.recipe.schema import Model


def model_architecture(model: Model) -> Architecture:
    """What memtrain reads from the recipe's model config (UserError for an architecture it cannot train).

    Its `notes` say what memtrain chose for the user (e.g. eager attention for Gemma-2): print them once.
    """
    return architecture(
        _hf_config(model), model.attn_implementation, key="model.preset" if model.preset else "model.path"
    )


def model_config(model: Model) -> PretrainedConfig:
    """The PretrainedConfig a recipe's `model` section describes (no weights are read), with the attention
    kernel the architecture runs with; UserError for an architecture memtrain cannot train."""
    config = _hf_config(model)
    key = "model.preset" if model.preset else "model.path"
    config._attn_implementation = architecture(config, model.attn_implementation, key=key).attn_implementation
    return config


def _hf_config(model: Model) -> PretrainedConfig:
    if model.preset:
        fields = dict(model_preset(model.preset))
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    try:
        directory = model_dir(model.path, model.revision, need="config")  # a Hub id: its config.json only
        return AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as error:  # no config.json, or a model_type this transformers does not know
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UserError(
            Problem(
                f"cannot read the model config in '{model.path}': {first_line}",
                key="model.path",
                hint="give a directory written by save_pretrained (config.json + weights); a "
                "model_type unknown here may need a newer transformers",
            )
        ) from None


def meta_model(model: Model, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """The model built on the meta device: real module tree and shapes, no memory, in milliseconds.

    Built with eager attention whatever the recipe's kernel: the kernel changes no parameter or module name,
    and flash_attention_2 would need its package installed where memtrain plans (a laptop, CI), which a plan
    for another machine must not."""
    config = model_config(model)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
