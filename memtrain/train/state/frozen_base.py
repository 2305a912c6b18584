"""The frozen base of a LoRA, QLoRA or DoRA run: left out of its checkpoints, checked again on resume.

A model with frozen parameters (requires_grad False: the base under the adapters) saves none of them in a checkpoint
(DeepSpeed's `exclude_frozen_parameters`): they never change, and a 7B base is ~13 GiB that every save would write and
copy through host memory, beside ~40 MB of adapters. A resume takes them from the model the recipe loads again, so
the checkpoint records what they were (`FROZEN_BASE_FILE`, written by rank 0 before the state file, and listed in
the manifest like every file) and the resume refuses another base, saying which tensors differ; then it loads the
module non-strictly and checks that what the checkpoint lacks is exactly the frozen parameters (`module_problem`).
A checkpoint without the file holds the whole module (a full fine-tune, or one saved before frozen parameters were
left out) and loads strictly, as before.

The record is, per frozen parameter and per quantisation entry (below), its shape, its dtype and a digest of
`SAMPLES` values at evenly spaced positions. Sampled, not whole: hashing a 7B base's 13 GiB at every
save and resume costs ~10 s of two cores (manifest.py's ~650 MB/s per core) and a copy off the GPU, while a handful
of values per tensor already differ in another checkpoint of the model, a preset initialised otherwise or a base
quantised otherwise; one small gather per tensor.

Quantised bases (QLoRA), read from bitsandbytes 0.50's nn/modules.py and functional.py, and run on its CPU backend
(tests/train/state/test_frozen_base.py: nf4 and int8 runs resume exactly; not run on a GPU, whose code paths here
are the same but for the CPU repacking `fingerprint` undoes): a 4-bit weight is a frozen `Params4bit` of packed
uint8 codes, and its scales live in `weight.quant_state` (QuantState: `absmax`, under double quantisation uint8 codes
with `state2.absmax` and `offset` beside them).
`Linear4bit._save_to_state_dict` adds those to the state dict as `<name>.weight.absmax`, `.quant_map`,
`.nested_absmax`, `.nested_quant_map` and `.quant_state.bitsandbytes__nf4`: entries that are no parameters, so
DeepSpeed keeps them when it leaves the frozen parameters out (a small share: ~1/64 byte per weight with double
quantisation). torch's `load_state_dict` never reads them back (Linear4bit has no `_load_from_state_dict`, and they
sit under the `weight` parameter's name, so torch does not even report them unexpected): the constants in use after
a resume were always those of the model loaded again, and the fingerprint covers them (`quantisation_entries`) so a
base quantised with other scales is refused too. LLM.int8's `Linear8bitLt` saves its row scales as `<name>.SCB`
(and `.weight_format`), and its `_load_from_state_dict` copies SCB back from the checkpoint: the same values, once
the fingerprint said the base is the same. Both sides of the key comparison come from the same `state_dict()`, so
those entries are neither missing nor unexpected.
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
    """The record of the module's frozen parameters and quantisation entries (see the module's text). Every rank
    calls it: under ZeRO-3 each holds a partition of every parameter, and the digests of all ranks' partitions are
    combined (one all-reduce)."""
    # through state_dict(): bitsandbytes' CPU kernels repack a 4-bit weight in place for inference (eval), and its
    # _save_to_state_dict puts the canonical packing back first
    state, params = module.state_dict(keep_vars=True), dict(module.named_parameters())
    entries = {name: state.get(name, params[name]) for name in frozen_names(module)} | quantisation_entries(
        module, state
    )
    local = [param.ds_tensor if hasattr(param, "ds_id") else param for param in entries.values()]
    digests = [hashlib.sha256(_sampled_bytes(tensor)).hexdigest() for tensor in local]
    if any(hasattr(param, "ds_id") for param in entries.values()) and torch.distributed.is_initialized():
        digests = _combined(digests, device)
    return {
        "scheme": SCHEME,
        "tensors": {
            name: {
                "shape": list(getattr(tensor, "ds_shape", tensor.shape)),
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "digest": digest,
            }
            for (name, tensor), digest in zip(entries.items(), digests)
        },
    }


def quantisation_entries(module: torch.nn.Module, state: dict | None = None) -> dict[str, torch.Tensor]:
    """The module's state-dict entries that are neither parameters nor buffers: what bitsandbytes adds beside a
    quantised weight (4-bit scales and code tables, LLM.int8's row scales and format). Read through state_dict(),
    which finds them where the layer keeps them now: Linear8bitLt moves SCB from its weight to its own state at the
    first forward, so the parameter's attributes would differ between a save and the resume that checks it."""
    known = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    known |= {name for name, _ in module.named_buffers(remove_duplicate=False)}
    return {
        name: tensor
        for name, tensor in (module.state_dict(keep_vars=True) if state is None else state).items()
        if name not in known and isinstance(tensor, torch.Tensor)
    }


def sample_positions(numel: int) -> torch.Tensor:
    """SAMPLES evenly spread indices into a flat tensor of `numel` elements, computed on the CPU wherever the tensor
    lives, so that a checkpoint saved on a GPU and checked on the CPU (or another GPU) samples the same elements.
    linspace runs in float32, which rounds the last index of a tensor past 2^24 elements up beyond its end (a 7B
    model's embedding: 545,259,520 for 545,259,519): clamped to the last element, every index a smaller tensor had
    before stays what it was, so the digests of checkpoints already saved still match."""
    positions = torch.linspace(0, numel - 1, min(SAMPLES, numel)).long()
    return positions.clamp_(max=numel - 1)


def _sampled_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return b""
    values = flat[sample_positions(flat.numel()).to(flat.device)].cpu().contiguous()
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


def load_without_base(state: dict, module: torch.nn.Module, checkpoint: Path) -> Problem | None:
    """Load a checkpoint's module state saved without the frozen parameters into `module` (non-strictly: the frozen
    ones stay as built), after checking its keys are the module's less those (`module_problem`, whose answer is
    returned instead of loading). Both key sets come from state_dict(): torch's own report of a non-strict load
    passes over keys under a parameter's name (bitsandbytes' 4-bit scales) and would call LLM.int8's weight_format
    unexpected."""
    problem = module_problem(set(state), set(module.state_dict()), set(frozen_names(module)), checkpoint)
    if problem is None:
        module.load_state_dict(state, strict=False)
    return problem


def base_key(model: Model) -> str:
    """The recipe key that names where the base comes from, for messages."""
    return "model.path" if model.path else "model.preset" if model.preset else "model"


def _names(names: list[str]) -> str:
    return ", ".join(names[:_SHOWN]) + (", …" if len(names) > _SHOWN else "")
