"""Export the trained model (or LoRA adapter) in Hugging Face format, atomically."""

from __future__ import annotations

from pathlib import Path

import torch

from memtrain.data.render.templates import conversation_template
from memtrain.files import atomic_path
from memtrain.model.merge import set_inference_config
from memtrain.recipe.schema import Data
from memtrain.train.eval.generation import stop_token_ids
from memtrain.train.runtime.distributed import barrier
from memtrain.train.state.storage import export_failed


def export_model(
    engine, model: torch.nn.Module, tokenizer, out_dir: Path, rank: int, zero3: bool, data: Data
) -> Path | None:
    """Write `out_dir` loadable with from_pretrained / PeftModel.from_pretrained (all ranks call this).

    Under ZeRO-3 the 16-bit weights are gathered from every rank first. The model is saved for inference
    (memtrain.model.merge.set_inference_config): use_cache on, and a generation_config.json that stops at the
    tokenizer's eos and at the end-of-turn token of the chat template the run trained with (`data`, the
    recipe's data section); an adapter gets that file too, for the merge to keep. The saved tokenizer's
    chat_template is the one the run trained with, so apply_chat_template writes what the model learnt.
    """
    state_dict = _without_wrapper_prefix(engine._zero3_consolidated_16bit_state_dict()) if zero3 else None
    if rank == 0:
        stop_ids = []
        template = conversation_template(data, tokenizer)  # preference pairs may use the tokenizer's own
        if template is not None:
            tokenizer.chat_template = template.source  # the template trained with (a shipped one replaces the own)
            stop_ids = stop_token_ids(data.template, tokenizer)
        generation = set_inference_config(model, tokenizer, stop_ids)
        try:
            with atomic_path(out_dir, directory=True) as tmp:
                if state_dict is not None:
                    model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
                else:
                    model.save_pretrained(tmp, safe_serialization=True)
                if not (tmp / "generation_config.json").is_file():  # a PEFT adapter saves none
                    generation.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
        except Exception as error:  # a full or read-only disk: atomic_path removed the partial export; say so
            failed = export_failed(Path(out_dir).parent, Path(out_dir), error, _export_bytes(model, state_dict))
            if failed is None:
                raise
            raise failed from None
    barrier()
    return out_dir if rank == 0 else None


def _export_bytes(model: torch.nn.Module, state_dict: dict | None) -> int:
    """About what the export writes: the gathered weights, an adapter's trainable ones, or the model's."""
    if state_dict is not None:
        return sum(t.numel() * t.element_size() for t in state_dict.values())
    adapter = hasattr(model, "peft_config")
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad or not adapter)


def _without_wrapper_prefix(state_dict: dict | None) -> dict | None:
    """ZeRO-3 gathers the weights of the engine's module (memtrain's TrainableLM); the export is of
    the model inside it, whose names lack the wrapper's `model.` prefix."""
    if state_dict is None:  # ranks other than 0 receive nothing
        return None
    prefix = "model."
    return {name[len(prefix) :] if name.startswith(prefix) else name: tensor for name, tensor in state_dict.items()}
