"""Export the trained model (or LoRA adapter) in Hugging Face format, atomically."""
from __future__ import annotations

from pathlib import Path

import torch

from memtrain.files import atomic_path
from memtrain.train.distributed import barrier


def export_model(engine, model: torch.nn.Module, tokenizer, out_dir: Path, rank: int, zero3: bool) -> Path | None:
    """Write `out_dir` loadable with from_pretrained / PeftModel.from_pretrained (all ranks call this).

    Under ZeRO-3 the 16-bit weights are gathered from every rank first.
    """
    state_dict = _without_wrapper_prefix(engine._zero3_consolidated_16bit_state_dict()) if zero3 else None
    if rank == 0:
        with atomic_path(out_dir, directory=True) as tmp:
            if state_dict is not None:
                model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
            else:
                model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
    barrier()
    return out_dir if rank == 0 else None


def _without_wrapper_prefix(state_dict: dict | None) -> dict | None:
    """ZeRO-3 gathers the weights of the engine's module (memtrain's TrainableLM); the export is of
    the model inside it, whose names lack the wrapper's `model.` prefix."""
    if state_dict is None:  # ranks other than 0 receive nothing
        return None
    prefix = "model."
    return {name[len(prefix):] if name.startswith(prefix) else name: tensor for name, tensor in state_dict.items()}
