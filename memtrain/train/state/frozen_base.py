"""The frozen base of a LoRA, QLoRA or DoRA run: left out of its checkpoints, checked again on resume.

A model with frozen parameters (requires_grad False: the base under the adapters) saves none of them in a checkpoint
(DeepSpeed's `exclude_frozen_parameters`): they never change, and a 7B base is ~13 GiB that every save would write and
copy through host memory, beside ~40 MB of adapters. A resume takes them from the model the recipe loads again, so
the checkpoint records what they were (`FROZEN_BASE_FILE`, written by rank 0 before the state file, and listed in
the manifest like every file) and the resume refuses another base, saying which tensors differ; then it loads the
module non-strictly and checks that what the checkpoint lacks is exactly the frozen parameters (`module_problem`).
A checkpoint without the file holds the whole module (a full fine-tune, or one saved before frozen parameters were
left out) and loads strictly, as before.

The record is, per frozen parameter, its shape, its dtype and a digest of `SAMPLES` values at evenly spaced
positions (and of its quantisation constants, below). Sampled, not whole: hashing a 7B base's 13 GiB at every
save and resume costs ~10 s of two cores (manifest.py's ~650 MB/s per core) and a copy off the GPU, while a handful
of values per tensor already differ in another checkpoint of the model, a preset initialised otherwise or a base
quantised otherwise; one small gather per tensor.

Quantised bases (QLoRA), read from bitsandbytes 0.50's nn/modules.py and functional.py (no GPU here to run it):
a 4-bit weight is a frozen `Params4bit` of packed uint8 codes, and its scales live in `weight.quant_state`
(QuantState: `absmax`, under double quantisation uint8 codes with `state2.absmax` and `offset` beside them).
`Linear4bit._save_to_state_dict` adds those to the state dict as `<name>.weight.absmax`, `.quant_map`,
`.nested_absmax`, `.nested_quant_map` and `.quant_state.bitsandbytes__nf4`: entries that are no parameters, so
DeepSpeed keeps them when it leaves the frozen parameters out (a small share: ~1/64 byte per weight with double
quantisation). torch's `load_state_dict` never reads them back (bitsandbytes has no `_load_from_state_dict`; they
sit under the `weight` parameter's name, so not even a strict load calls them unexpected): the constants in use
after a resume were always those of the model loaded again, and the fingerprint covers them (`absmax`, and the
nested level's) so a base quantised with other scales is refused too. LLM.int8's `Int8Params` keeps its row scales
in `SCB` the same way. Both sides of the key comparison come from the same `state_dict()`, so those entries are
neither missing nor unexpected.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from memtrain.errors import Problem
from memtrain.recipe.schema import Model
from memtrain.train.runtime.distributed import all_reduce_sum

FROZEN_BASE_FILE = "frozen_base.json"
SAMPLES = 64  # values read per frozen tensor (and per quantisation constant)
SCHEME = "sampled-64-sha256"  # recorded, so another way of fingerprinting can be told apart
_SHOWN = 3  # tensor names a message names before "…"


def frozen_names(module: torch.nn.Module) -> list[str]:
    """The frozen parameters' names, as DeepSpeed's `module_state_dict(exclude_frozen_parameters=True)` leaves them
    out: `named_parameters()`, so a parameter tied to another is named once (a tied frozen embedding stays in the
    checkpoint under its second name, and loads back into the same tensor)."""
    return [name for name, param in module.named_parameters() if not param.requires_grad]


def has_frozen_parameters(module: torch.nn.Module) -> bool:
    return any(not param.requires_grad for param in module.parameters())


def fingerprint(module: torch.nn.Module, device: torch.device | None = None) -> dict:
    """The record of the module's frozen parameters (see the module's text). Every rank calls it: under ZeRO-3 each
    holds a partition of every parameter, and the digests of all ranks' partitions are combined (one all-reduce)."""
    names, digests, params = [], [], dict(module.named_parameters())
    for name in frozen_names(module):
        names.append(name)
        digests.append(_local_digest(params[name]))
    if any(hasattr(params[name], "ds_id") for name in names) and torch.distributed.is_initialized():
        digests = _combined(digests, device)
    tensors = {}
    for name, digest in zip(names, digests):
        param = params[name]
        shape = list(getattr(param, "ds_shape", param.shape))
        tensors[name] = {"shape": shape, "dtype": str(param.dtype).removeprefix("torch."), "digest": digest}
    return {"scheme": SCHEME, "tensors": tensors}


def _local_digest(param: torch.Tensor) -> str:
    """The digest of this rank's copy of one frozen parameter: its values at SAMPLES evenly spaced positions, and
    those of its quantisation constants."""
    local = param.ds_tensor if hasattr(param, "ds_id") else param.data
    h = hashlib.sha256()
    for tensor in (local, *quantisation_constants(param)):
        h.update(_sampled_bytes(tensor))
    return h.hexdigest()


def quantisation_constants(param: torch.Tensor) -> list[torch.Tensor]:
    """The scales bitsandbytes keeps beside a quantised weight (Params4bit's quant_state, Int8Params' SCB)."""
    state = getattr(param, "quant_state", None)
    found = [getattr(state, "absmax", None), getattr(state, "offset", None)]
    found.append(getattr(getattr(state, "state2", None), "absmax", None))
    found.append(getattr(param, "SCB", None))
    return [t for t in found if isinstance(t, torch.Tensor)]


def _sampled_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return b""
    positions = torch.linspace(0, flat.numel() - 1, min(SAMPLES, flat.numel()), device=flat.device).long()
    values = flat[positions].cpu().contiguous()
    return values.view(torch.uint8).numpy().tobytes() + str(tuple(tensor.shape)).encode()


def _combined(digests: list[str], device: torch.device | None) -> list[str]:
    """Each tensor's digest over every rank's partition: each rank's 48 bits in its own row of a table all ranks sum."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    table = torch.zeros(world, len(digests), dtype=torch.int64, device=device)
    table[rank] = torch.tensor([int(d[:12], 16) for d in digests], dtype=torch.int64)
    rows = all_reduce_sum(table).cpu().tolist()
    return [hashlib.sha256(repr([row[i] for row in rows]).encode()).hexdigest() for i in range(len(digests))]


def write_record(directory: Path, record: dict) -> None:
    (Path(directory) / FROZEN_BASE_FILE).write_text(json.dumps(record, indent=1))


def read_record(checkpoint: Path) -> dict | None:
    """The frozen base a checkpoint was trained over; None when it holds the whole module."""
    path = Path(checkpoint) / FROZEN_BASE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def base_problem(recorded: dict, now: dict, checkpoint: Path, key: str = "model") -> Problem | None:
    """What differs between the base a checkpoint was trained over and the one this run loaded (None: the same)."""
    old, new = recorded.get("tensors", {}), now["tensors"]
    if recorded.get("scheme") != now["scheme"]:
        what = f"it was fingerprinted another way ({recorded.get('scheme')}), so it cannot be compared"
    elif set(old) != set(new):
        gone, added = sorted(set(old) - set(new)), sorted(set(new) - set(old))
        what = "the frozen parameters are others: " + "; ".join(
            part
            for part in (
                f"{len(gone)} gone ({_names(gone)})" if gone else "",
                f"{len(added)} new ({_names(added)})" if added else "",
            )
            if part
        )
    else:
        layout = [n for n in old if (old[n]["shape"], old[n]["dtype"]) != (new[n]["shape"], new[n]["dtype"])]
        values = [n for n in old if old[n]["digest"] != new[n]["digest"]]
        if layout:
            first = layout[0]
            what = (
                f"{len(layout)} of {len(old)} frozen tensors have another shape or dtype ({_names(layout)}: "
                f"{first} was {old[first]['dtype']} {old[first]['shape']}, is {new[first]['dtype']} "
                f"{new[first]['shape']})"
            )
        elif values:
            what = f"{len(values)} of {len(old)} frozen tensors hold other values ({_names(values)})"
        else:
            return None
    return Problem(
        f"the frozen base weights differ from those checkpoint {checkpoint.name} was trained over: {what}. The "
        "checkpoint holds only the trained parameters; the base comes from the model the recipe loads",
        key=key,
        hint="point the recipe at the base the run was trained on (the same files, revision and quantisation) to "
        "resume it",
    )


def module_problem(saved: set[str], model: set[str], frozen: set[str], checkpoint: Path) -> Problem | None:
    """Why a checkpoint saved without its frozen parameters does not fit this model (None: it does): the keys it
    lacks must be exactly the frozen parameters, and it must hold no key the model does not have."""
    missing, unexpected = model - saved, saved - model
    if missing == frozen and not unexpected:
        return None
    parts = [
        f"{len(keys)} {what} ({_names(sorted(keys))})"
        for keys, what in (
            (missing - frozen, "trained tensors missing from the checkpoint"),
            (frozen - missing, "frozen tensors saved in it"),
            (unexpected, "tensors this model does not have"),
        )
        if keys
    ]
    return Problem(
        f"checkpoint {checkpoint.name} does not fit this model: " + "; ".join(parts),
        hint="resume with the recipe and the memtrain the run was trained with",
    )


def base_key(model: Model) -> str:
    """The recipe key that names where the base comes from, for messages."""
    return "model.path" if model.path else "model.preset" if model.preset else "model"


def _names(names: list[str]) -> str:
    return ", ".join(names[:_SHOWN]) + (", …" if len(names) > _SHOWN else "")
