"""Export the trained model (or LoRA adapter) in Hugging Face format, atomically."""
from __future__ import annotations

from pathlib import Path

import torch

from memtrain.files import atomic_path
from memtrain.train.distributed import barrier


def export_model(engine, model: torch.nn.Module, tokenizer, out_dir: Path, rank: int, zero3: bool) -> Path | None:
    """Write `out_dir` loadable with from_pretrained / PeftModel.from_pretrained (all ranks call this).

    Under ZeRO-3 the 16-bit weights are gathered from every rank first. The model is saved for inference
    (memtrain.model.merge.set_inference_config): use_cache on, and a generation_config.json that stops at the
    tokenizer's eos and at the end-of-turn token of the chat template the run trained with (the recipe the
    run directory records, out_dir's parent); an adapter gets that file too, for the merge to keep.
    """
    state_dict = _without_wrapper_prefix(engine._zero3_consolidated_16bit_state_dict()) if zero3 else None
    if rank == 0:
        from memtrain.model.merge import set_inference_config

        generation = set_inference_config(model, tokenizer, _stop_ids(out_dir.parent, tokenizer))
        with atomic_path(out_dir, directory=True) as tmp:
            if state_dict is not None:
                model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
            else:
                model.save_pretrained(tmp, safe_serialization=True)
            if not (tmp / "generation_config.json").is_file():  # a PEFT adapter saves none
                generation.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    barrier()
    return out_dir if rank == 0 else None


def _stop_ids(run_dir: Path, tokenizer) -> list[int]:
    """The tokens that end an answer of the run's chat template (its end-of-turn token and the tokenizer's eos),
    as `memtrain eval` stops at them; none for text-only data or a directory without the run's recipe.json."""
    if not (run_dir / "recipe.json").is_file():
        return []
    from memtrain.data.templates import needs_template
    from memtrain.model.export import run_recipe
    from memtrain.train.generate_eval import stop_token_ids

    data = run_recipe(run_dir).data
    return stop_token_ids(data.template, tokenizer) if needs_template(data) else []


def _without_wrapper_prefix(state_dict: dict | None) -> dict | None:
    """ZeRO-3 gathers the weights of the engine's module (memtrain's TrainableLM); the export is of
    the model inside it, whose names lack the wrapper's `model.` prefix."""
    if state_dict is None:  # ranks other than 0 receive nothing
        return None
    prefix = "model."
    return {name[len(prefix):] if name.startswith(prefix) else name: tensor for name, tensor in state_dict.items()}
