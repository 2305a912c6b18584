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

Every model memtrain saves for use (a run's final/, a merged export) goes through `set_inference_config`:
use_cache on (training turns it off), the special-token ids the tokenizer's, and a generation config that
stops at the tokenizer's eos and at the chat template's end-of-turn token (<|im_end|> for chatml), so that
`generate()` ends an answer where training taught it to, as TRL / Axolotl exports do. A run's final/
carries those stop ids in its generation_config.json (an adapter's too), and the merge keeps them.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from memtrain.errors import Problem, UserError
from memtrain.files import directory_atomically, require_space
from memtrain.model.peft_quiet import peft_quietly
from memtrain.model.quantize import bnb_config, require_bitsandbytes
from memtrain.recipe.schema import Quantize


def merge_adapter(
    adapter_dir: Path,
    base: Path | PreTrainedModel,
    out_dir: Path,
    dtype: torch.dtype = torch.bfloat16,
    *,
    quantize: Quantize | None = None,
    tokenizer_dir: Path | None = None,
) -> Path:
    """Merge the PEFT adapter in `adapter_dir` into `base` and save the result to `out_dir`; returns out_dir.

    base: the base model's directory (loaded in `dtype` on the CPU), or a loaded model — which the merge
    changes in place. quantize: the run's `model.quantize` for a QLoRA adapter (see the module docstring).
    tokenizer_dir: where the tokenizer is (default: the adapter directory, else the base directory).
    The merged model stops generating at the tokenizer's eos and at the ids the adapter directory's
    generation_config.json lists (a run's end-of-turn token), with use_cache on (`set_inference_config`).
    `out_dir` is written whole or not at all; it must not exist yet (or be empty).
    """
    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise UserError(
            Problem(
                f"'{adapter_dir}' holds no PEFT adapter (adapter_config.json)",
                hint="give the directory a LoRA run exported (RUN_DIR/final)",
            )
        )
    with directory_atomically(out_dir) as tmp:  # a taken or unwritable out_dir is said before the base loads
        tokenizer = _tokenizer(tokenizer_dir, adapter_dir, base)
        model = base if isinstance(base, PreTrainedModel) else load_base(Path(base), dtype, quantize)
        merged = _merged(model, adapter_dir).to(dtype)
        set_inference_config(merged, tokenizer, _stop_ids(adapter_dir))
        require_space(out_dir, _weight_bytes(merged), "the merged model")
        merged.save_pretrained(tmp)  # safetensors, with config.json and generation_config.json
        tokenizer.save_pretrained(tmp)  # tokenizer files and the chat template
    return out_dir


def _weight_bytes(model: PreTrainedModel) -> int:
    """What save_pretrained writes, near enough: every parameter and buffer (tied weights once)."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def set_inference_config(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, stop_ids: Iterable[int] = ()
) -> GenerationConfig:
    """Make `model` (a Hugging Face model, or a PEFT model around one) ready to be saved for inference; returns
    its generation config, which save_pretrained writes as generation_config.json (a PEFT adapter's does not:
    the caller saves it beside the adapter).

    config.use_cache: on. bos / pad ids: the tokenizer's (bos kept where the tokenizer has none). eos: the
    tokenizer's, after `stop_ids` (the chat template's end-of-turn token) in the generation config, plus
    the ids the configs already list that are the tokenizer's special tokens (Llama-3.1's three end tokens
    stay; a preset's default eos 2, a plain character, goes).
    """
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = lm.config
    generation = (
        lm.generation_config
        if getattr(lm, "generation_config", None) is not None
        else GenerationConfig.from_model_config(config)
    )
    kept = _end_tokens(tokenizer)
    eos = tokenizer.eos_token_id
    for target, first in ((config, []), (generation, list(stop_ids))):
        if tokenizer.bos_token_id is not None:
            target.bos_token_id = tokenizer.bos_token_id
        target.pad_token_id = tokenizer.pad_token_id
        ids = first + [eos] + [i for i in _ids(target.eos_token_id) if i in kept]
        ids = [i for n, i in enumerate(ids) if i is not None and i not in ids[:n]]
        target.eos_token_id = ids[0] if len(ids) == 1 else ids or None
    config.use_cache = True
    generation.use_cache = True
    generation._from_model_config = False  # its own values, not to be re-derived from config.json
    lm.generation_config = generation
    return generation


def _ids(value) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def _end_tokens(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Ids that may end generation: the tokenizer's special tokens other than its bos (unless bos is also eos).
    The pad is one of them: Qwen2.5-Instruct's and Qwen3's configs list <|endoftext|>, their pad, beside
    <|im_end|>; an export that keeps only <|im_end|> never stops at the base's document end."""
    special = set(tokenizer.all_special_ids)
    special.update(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
    if tokenizer.bos_token_id != tokenizer.eos_token_id:
        special.discard(tokenizer.bos_token_id)
    return special


def _stop_ids(adapter_dir: Path) -> list[int]:
    """The eos ids of the generation config a run saved beside its adapter (none for an adapter without one)."""
    if not (adapter_dir / "generation_config.json").is_file():
        return []
    return _ids(GenerationConfig.from_pretrained(adapter_dir).eos_token_id)


def load_base(base_dir: Path, dtype: torch.dtype, quantize: Quantize | None = None) -> PreTrainedModel:
    """The base model on the CPU in `dtype`; with a quantised run's `quantize`, the weights it trained
    against: quantised as training loaded them, then dequantised to `dtype`."""
    if not (base_dir / "config.json").is_file():
        raise UserError(
            Problem(
                f"the base model directory '{base_dir}' has no config.json",
                key="model.path",
                hint="the merge needs the base weights the adapter was trained on",
            )
        )
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
        with peft_quietly():
            peft_model = PeftModel.from_pretrained(model, adapter_dir, is_trainable=False)
    except (ValueError, RuntimeError, KeyError) as error:  # adapter of another architecture or shape
        raise UserError(
            Problem(
                f"the adapter in '{adapter_dir}' does not fit this base model: {str(error).splitlines()[0]}", hint=hint
            )
        ) from None
    # PEFT loads an adapter whose modules only partly exist in the base and merely warns about the rest:
    # a merge would then silently drop trained weights, so every saved tensor must have found its place.
    dropped = sorted(
        set(load_peft_weights(str(adapter_dir), device="cpu")) - set(get_peft_model_state_dict(peft_model))
    )
    if dropped:
        raise UserError(
            Problem(
                f"{len(dropped)} adapter tensors in '{adapter_dir}' have no module in this base model "
                f"(e.g. {dropped[0]}): it is not the model the adapter was trained on",
                hint=hint,
            )
        )
    # safe_merge checks each merged weight for NaN/inf before it replaces the original
    return peft_model.merge_and_unload(safe_merge=True)


def _tokenizer(tokenizer_dir: Path | None, adapter_dir: Path, base: Path | PreTrainedModel):
    candidates = [tokenizer_dir] if tokenizer_dir is not None else [adapter_dir]
    if tokenizer_dir is None and not isinstance(base, PreTrainedModel):
        candidates.append(Path(base))
    for directory in candidates:
        if any(
            (Path(directory) / name).is_file()
            for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        ):
            return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    raise UserError(
        Problem(
            f"no tokenizer in {', '.join(str(c) for c in candidates)}",
            hint="a merged model is saved with its tokenizer and chat template; give the "
            "directory that has tokenizer.json / tokenizer_config.json",
        )
    )
