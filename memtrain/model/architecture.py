"""What memtrain needs to know about a model's architecture, decided from its Hugging Face config
before anything is built.

memtrain fine-tunes decoder-only causal language models: a body of decoder layers and an output head
trained on next-token prediction. A config that is not one (an encoder such as BERT, an
encoder-decoder such as T5, a vision or multimodal model) is refused here, with the reason and what to
use instead, instead of failing minutes later inside transformers or, worse, training something
meaningless. Everything else an architecture needs is read from the config too, never from Llama
formulas: the attention kernel it can run with, its layer count, tied embeddings, vocabulary, and
the soft-cap Gemma-2 applies to its output logits.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from transformers import PretrainedConfig

from memtrain.errors import Problem, UserError
from memtrain.model.varlen import ATTN_NAME as VARLEN
from memtrain.model.varlen import varlen_available

DECODER_EXAMPLES = "Llama, Qwen2/Qwen3, Mistral, Gemma-2, Phi-3"


@dataclass(frozen=True)
class Architecture:
    """The facts memtrain reads from a causal LM's config (one owner for each)."""

    model_type: str
    causal_lm_class: str  # the transformers class AutoModelForCausalLM builds, e.g. "Gemma2ForCausalLM"
    num_layers: int  # decoder layers
    vocab_size: int
    tied_embeddings: bool  # the output head shares the input embedding's weight
    attn_implementation: str  # the kernel memtrain builds the model with (may differ from the recipe's)
    logit_softcap: float | None  # output logits become tanh(logits / cap) * cap before the loss (Gemma-2)
    sliding_window_tokens: int | None  # attention window of the windowed layers, None when all are global
    notes: tuple[str, ...] = ()  # choices memtrain made for the user; the caller says each once


def architecture(config: PretrainedConfig, attn_implementation: str = "sdpa", key: str = "model.path") -> Architecture:
    """The architecture of `config` with the attention kernel it will run with, or UserError when
    memtrain cannot fine-tune it.

    attn_implementation: what the recipe asks for (model.attn_implementation).
    key: the recipe key the config came from, for the error's location.
    """
    class_name = causal_lm_class_name(config, key)
    attention, notes = _attention(config, class_name, attn_implementation)
    text = config.get_text_config()
    return Architecture(
        model_type=config.model_type,
        causal_lm_class=class_name,
        num_layers=int(text.num_hidden_layers),
        vocab_size=int(text.vocab_size),
        tied_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
        attn_implementation=attention,
        logit_softcap=logit_softcap(config),
        sliding_window_tokens=_sliding_window(text),
        notes=notes,
    )


def logit_softcap(config: PretrainedConfig) -> float | None:
    """The cap Gemma-2 applies to its output logits (`final_logit_softcapping`), None for most models.

    The model's own forward applies it after its lm_head; memtrain's chunked loss calls the lm_head
    itself, so it must apply the cap too, or it trains a different function than the model computes.
    """
    cap = getattr(config.get_text_config(), "final_logit_softcapping", None)
    return float(cap) if cap else None


def causal_lm_class_name(config: PretrainedConfig, key: str = "model.path") -> str:
    """The AutoModelForCausalLM class name for this config, or UserError saying why it is not a decoder LM."""
    from transformers.models.auto import modeling_auto as auto

    model_type = config.model_type
    if _is_multimodal(config):
        text = config.get_text_config()
        text_type = getattr(text, "model_type", None)
        instead = (
            f"fine-tune its language model alone: a directory whose config.json has model_type "
            f"'{text_type}' (save the text model's weights with save_pretrained)"
            if text_type and text_type != model_type and text_type in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            else f"use a text-only causal LM ({DECODER_EXAMPLES})"
        )
        raise UserError(
            Problem(
                f"'{model_type}' is a multimodal model (it has a vision or audio encoder); memtrain trains "
                "text-only causal language models, and its data carries no images or audio",
                key=key,
                hint=instead,
            )
        )
    if getattr(config, "is_encoder_decoder", False):
        raise UserError(
            Problem(
                f"'{model_type}' is an encoder-decoder (sequence-to-sequence) model; memtrain trains decoder-only "
                "causal language models, whose loss is next-token prediction over one sequence",
                key=key,
                hint=f"use a decoder-only model ({DECODER_EXAMPLES}), or transformers' Seq2SeqTrainer for {model_type}",
            )
        )
    causal = auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        # BERT-like models do have a *ForCausalLM class, but only as the decoder half of an
        # encoder-decoder: their pretrained weights attend both ways and were never trained to predict
        # the next token, so "fine-tuning" them here would start from an untrained language model.
        raise UserError(
            Problem(
                f"'{model_type}' is an encoder-only (masked language) model: it attends to the whole sequence "
                "and has no next-token head to fine-tune",
                key=key,
                hint=f"use a decoder-only causal LM ({DECODER_EXAMPLES}); for classification or masked-LM "
                f"training of {model_type} use transformers' Trainer",
            )
        )
    if causal is None:
        what = "a vision model" if _is_vision(model_type) else "not a causal language model"
        raise UserError(
            Problem(
                f"'{model_type}' is {what}: transformers has no AutoModelForCausalLM class for it",
                key=key,
                hint=f"use a decoder-only causal LM ({DECODER_EXAMPLES})",
            )
        )
    return causal


def _is_multimodal(config: PretrainedConfig) -> bool:
    """A composite config with a non-text encoder (LLaVA, Qwen2-VL, Gemma-3, Mllama, Whisper-like)."""
    return any(getattr(config, name, None) is not None for name in ("vision_config", "audio_config", "vision_tower"))


def _is_vision(model_type: str) -> bool:
    from transformers.models.auto import modeling_auto as auto

    vision = (
        "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
        "MODEL_FOR_IMAGE_MAPPING_NAMES",
        "MODEL_FOR_OBJECT_DETECTION_MAPPING_NAMES",
        "MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES",
    )
    return any(model_type in getattr(auto, name, {}) for name in vision)


def _attention(config: PretrainedConfig, class_name: str, requested: str) -> tuple[str, tuple[str, ...]]:
    """(the kernel to build with, notes): the recipe's kernel, or eager where sdpa would be refused or wrong.

    sdpa is refused by the model classes that declare `_supports_sdpa = False`, and it is wrong for
    soft-capped attention scores (Gemma-2's `attn_logit_softcapping`): transformers' sdpa path drops the
    cap, so the model would train with different attention than it was pretrained with. flash_attention_2
    applies the cap; eager does too, at the cost of materialising the batch × heads × seq² scores,
    which `memtrain plan` counts because it traces the kernel the model is built with.

    auto (not yet made concrete for a machine: memtrain.model.attention) is sdpa here. varlen is sdpa for
    everything but packed rows, so it falls back to eager where sdpa does, and is built as its registered name.
    """
    import transformers

    cls = getattr(transformers, class_name, None)
    supports_sdpa = bool(getattr(cls, "_supports_sdpa", True))
    supports_flash = bool(getattr(cls, "_supports_flash_attn", getattr(cls, "_supports_flash_attn_2", False)))
    softcap = getattr(config.get_text_config(), "attn_logit_softcapping", None)
    if requested == "flash_attention_2" and not supports_flash:
        raise UserError(
            Problem(
                f"{class_name} has no FlashAttention-2 implementation in the installed transformers "
                f"({transformers.__version__})",
                key="model.attn_implementation",
                hint="set model.attn_implementation: sdpa (or eager)",
            )
        )
    varlen = requested == "varlen"
    if requested in ("auto", "varlen"):
        requested = "sdpa"
    if requested != "sdpa" or (supports_sdpa and not softcap):
        return (VARLEN if varlen else requested), ()
    why = (
        f"its attention scores are soft-capped (attn_logit_softcapping={softcap:g}), which sdpa ignores"
        if softcap
        else f"{class_name} does not support sdpa in transformers {transformers.__version__}"
    )
    flash = (
        " model.attn_implementation: flash_attention_2 keeps the cap without them (CUDA, flash-attn installed)."
        if supports_flash
        else ""
    )
    return "eager", (
        f"{config.model_type}: attention runs in eager mode because {why}; eager keeps the "
        f"batch × heads × seq² attention scores, which `memtrain plan` counts.{flash}",
    )


def check_attention_kernel(
    attn_implementation: str, on_gpu: bool, flash_installed: bool | None = None, varlen_runs: bool | None = None
) -> None:
    """Before a run builds anything: FlashAttention-2 needs a CUDA GPU and the flash-attn package, varlen a CUDA GPU
    of compute capability 8.0 or newer. `plan` and `compile` take them anywhere (they price and configure a run
    elsewhere); `run` refuses them where they cannot run instead of failing inside transformers after the data and
    the model are built. flash_installed, varlen_runs: None asks this machine."""
    if attn_implementation == "varlen":
        if not (varlen_available() if varlen_runs is None else varlen_runs):
            raise UserError(
                Problem(
                    "model.attn_implementation: varlen runs PyTorch's flash kernel, which needs a CUDA GPU of compute "
                    "capability 8.0 or newer (Ampere, Ada, Hopper) and PyTorch 2.10 or newer; this machine has none",
                    key="model.attn_implementation",
                    hint="set model.attn_implementation: auto (it takes varlen where it runs, sdpa elsewhere)",
                )
            )
        return
    if attn_implementation != "flash_attention_2":
        return
    if flash_installed is None:
        flash_installed = importlib.util.find_spec("flash_attn") is not None
    if not on_gpu:
        raise UserError(
            Problem(
                "FlashAttention-2 runs on CUDA GPUs, and this machine has none",
                key="model.attn_implementation",
                hint="set model.attn_implementation: sdpa to run here (plan and compile accept "
                "flash_attention_2 on any machine)",
            )
        )
    if not flash_installed:
        raise UserError(
            Problem(
                "model.attn_implementation: flash_attention_2 needs the flash-attn package, which is not installed",
                key="model.attn_implementation",
                hint="pip install flash-attn --no-build-isolation, or set model.attn_implementation: sdpa",
            )
        )


def _sliding_window(text: PretrainedConfig) -> int | None:
    """The window of the sliding-window layers: Qwen2 configs carry one that is off unless use_sliding_window."""
    window = getattr(text, "sliding_window", None)
    if not window or getattr(text, "use_sliding_window", True) is False:
        return None
    return int(window)
