"""The model's Hugging Face config, from a shape preset or a local directory, without weights."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from memtrain.configs import model_preset
from memtrain.recipe.schema import Model


def model_config(model: Model) -> PretrainedConfig:
    """The PretrainedConfig a recipe's `model` section describes (no weights are read)."""
    if model.preset:
        fields = dict(model_preset(model.preset))
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    else:
        config = AutoConfig.from_pretrained(Path(model.path), local_files_only=True)
    config._attn_implementation = model.attn_implementation
    return config


def meta_model(model: Model, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """The model built on the meta device: real module tree and shapes, no memory, in milliseconds."""
    config = model_config(model)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)
