"""A LoRA adapter merged into its base weights and saved as a plain Hugging Face model.

The merged model loads with `AutoModelForCausalLM.from_pretrained` alone — no PEFT, no base
directory — and computes what base + adapter computed: each adapted weight becomes W + scale · B A
(DoRA: the re-normalised direction times its magnitude), and each of `modules_to_save` is replaced
by its trained copy. The tokenizer and its chat template are saved beside it, so serving stacks and
llama.cpp's converter find everything in one directory.

QLoRA: the adapter was trained against the 4-bit (or 8-bit) weights, not the original bf16 ones; the
two differ by the quantisation error, about as large as what a small adapter changes. So the base is
loaded quantised exactly as training loaded it, dequantised back to `dtype` (transformers'
`PreTrainedModel.dequantize`), and the adapter is merged onto those weights: the merged model computes
what the trained one did, in full precision, with no bitsandbytes needed to load it.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from memtrain.errors import Problem, UserError
from memtrain.files import directory_atomically
from memtrain.model.quantize import bnb_config, require_bitsandbytes
from memtrain.recipe.schema import Quantize


def merge_adapter(adapter_dir: Path, base: Path | PreTrainedModel, out_dir: Path,
                  dtype: torch.dtype = torch.bfloat16, *, quantize: Quantize | None = None,
                  tokenizer_dir: Path | None = None) -> Path:
    """Merge the PEFT adapter in `adapter_dir` into `base` and save the result to `out_dir`; returns out_dir.

    base: the base model's directory (loaded in `dtype` on the CPU), or a loaded model — which the merge
    changes in place. quantize: the run's `model.quantize` for a QLoRA adapter (see the module docstring).
    tokenizer_dir: where the tokenizer is (default: the adapter directory, else the base directory).
    `out_dir` is written whole or not at all; it must not exist yet (or be empty).
    """
    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise UserError(Problem(f"'{adapter_dir}' holds no PEFT adapter (adapter_config.json)",
                                hint="give the directory a LoRA run exported (RUN_DIR/final)"))
    _refuse_existing(out_dir)
    tokenizer = _tokenizer(tokenizer_dir, adapter_dir, base)
    model = base if isinstance(base, PreTrainedModel) else load_base(Path(base), dtype, quantize)
    merged = _merged(model, adapter_dir).to(dtype)
    with directory_atomically(out_dir) as tmp:
        merged.save_pretrained(tmp)  # safetensors, with config.json and generation_config.json
        tokenizer.save_pretrained(tmp)  # tokenizer files and the chat template
    return out_dir


def load_base(base_dir: Path, dtype: torch.dtype, quantize: Quantize | None = None) -> PreTrainedModel:
    """The base model on the CPU in `dtype`; with a quantised run's `quantize`, the weights it trained
    against: quantised as training loaded them, then dequantised to `dtype`."""
    if not (base_dir / "config.json").is_file():
        raise UserError(Problem(f"the base model directory '{base_dir}' has no config.json", key="model.path",
                                hint="the merge needs the base weights the adapter was trained on"))
    quantized = quantize is not None and quantize.type != "none"
    extra = {}
    if quantized:
        require_bitsandbytes()
        extra = {"quantization_config": bnb_config(quantize, dtype), "device_map": {"": "cpu"}}
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype, local_files_only=True, **extra)
    if quantized:
        model = model.dequantize()
    return model


def _merged(model: PreTrainedModel, adapter_dir: Path) -> PreTrainedModel:
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict, load_peft_weights

    hint = "merge onto the base model the adapter was trained on (the run's model.path)"
    try:
        peft_model = PeftModel.from_pretrained(model, adapter_dir, is_trainable=False)
    except (ValueError, RuntimeError, KeyError) as error:  # adapter of another architecture or shape
        raise UserError(Problem(
            f"the adapter in '{adapter_dir}' does not fit this base model: {str(error).splitlines()[0]}",
            hint=hint)) from None
    # PEFT loads an adapter whose modules only partly exist in the base and merely warns about the rest:
    # a merge would then silently drop trained weights, so every saved tensor must have found its place.
    dropped = sorted(set(load_peft_weights(str(adapter_dir), device="cpu")) - set(get_peft_model_state_dict(peft_model)))
    if dropped:
        raise UserError(Problem(
            f"{len(dropped)} adapter tensors in '{adapter_dir}' have no module in this base model "
            f"(e.g. {dropped[0]}): it is not the model the adapter was trained on", hint=hint))
    # safe_merge checks each merged weight for NaN/inf before it replaces the original
    return peft_model.merge_and_unload(safe_merge=True)


def _tokenizer(tokenizer_dir: Path | None, adapter_dir: Path, base: Path | PreTrainedModel):
    candidates = [tokenizer_dir] if tokenizer_dir is not None else [adapter_dir]
    if tokenizer_dir is None and not isinstance(base, PreTrainedModel):
        candidates.append(Path(base))
    for directory in candidates:
        if any((Path(directory) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    raise UserError(Problem(f"no tokenizer in {', '.join(str(c) for c in candidates)}",
                            hint="a merged model is saved with its tokenizer and chat template; give the "
                                 "directory that has tokenizer.json / tokenizer_config.json"))


def _refuse_existing(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(Problem(f"the output directory '{out_dir}' already exists and is not empty",
                                hint="choose a new directory (-o), or remove this one first"))
