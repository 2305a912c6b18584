"""The precomputed reference (preference.reference: precomputed): the initial model's log-probabilities of every pair,
computed in one no-gradient pass before training and stored beside the token cache, so a full fine-tune's DPO holds
one model in memory (TRL's precompute_ref_log_probs).

The file is keyed by what decides its numbers: the pairs (the data's digest, rows/identity.py), the initial model
(the recipe's model section, the weight files' sizes and times, the seed a preset starts from) and the precision the
log-probabilities are computed in. A resumed run, or a second run on the same data and model, reads it instead of
running the pass again. The pass runs before a checkpoint is loaded, so it always sees the initial weights. It is
written atomically by rank 0: a run killed during the pass leaves no file, and the next one computes it again.

Each rank computes its share of the pairs; one all-reduce of the zero-filled table gives every rank all of it.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import torch

from memtrain.data.rows.identity import dataset_digest
from memtrain.data.tokens.cache import cache_dir_of
from memtrain.files import write_atomically
from memtrain.recipe.schema import Recipe
from memtrain.train.runtime.distributed import Place, all_reduce_sum, pair_forwards

REFERENCE_VERSION = "1"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".json")


def model_identity(recipe: Recipe) -> dict:
    """What makes the initial model's numbers: the model section, its files (name, size, mtime), seed, precision."""
    files = []
    if recipe.model.path:
        root = Path(recipe.model.path)
        files = sorted(
            (p.name, p.stat().st_size, p.stat().st_mtime_ns)
            for p in (root.iterdir() if root.is_dir() else ())
            if p.suffix in WEIGHT_SUFFIXES
        )
    return {
        "model": recipe.model.model_dump(mode="json"),
        "files": files,
        "seed": recipe.train.seed,
        "precision": [recipe.precision.compute, recipe.precision.storage, recipe.precision.fp32_loss],
    }


def reference_path(recipe: Recipe, dataset) -> Path:
    """Where the reference log-probabilities of `dataset` under the recipe's initial model are stored."""
    key = json.dumps(
        {"version": REFERENCE_VERSION, "data": dataset_digest(dataset), "model": model_identity(recipe)},
        sort_keys=True,
    )
    return cache_dir_of(recipe.data.cache_dir) / "reference" / f"{hashlib.sha256(key.encode()).hexdigest()}.npy"


@torch.no_grad()
def compute_reference(module, loader, dataset, *, micro_batch: int, place: Place) -> np.ndarray:
    """float32 (pairs, 2): each pair's summed log-probabilities of the chosen and the rejected completion.

    module: the PreferenceLM (its reference_logps); loader: a BatchLoader over `dataset` without references.
    """
    table = torch.zeros((len(dataset), 2), dtype=torch.float64, device=place.device)
    mine = list(range(place.rank, len(dataset), place.world_size))
    batches = loader.split(mine, micro_batch)  # the loader's layout: pairs cut to their longest, or laid out packed
    extra = pair_forwards(len(batches), place)  # ZeRO-3 gathers in every forward: each rank runs as many
    was_training = module.training
    module.eval()  # no dropout: the reference is one fixed function
    try:
        for at, indices in enumerate(batches):
            if at + 1 < len(batches):
                loader.prefetch(batches[at + 1])
            logps = module.reference_logps(**loader.get(indices)).double()
            n = len(indices)
            table[indices] = torch.stack([logps[:n], logps[n:]], dim=1)
        spare = batches[0] if batches else loader.split([0], micro_batch)[0]
        for _ in range(extra):  # its gathers only: nothing is kept
            module.reference_logps(**loader.get(spare))
    finally:
        module.train(was_training)
    return all_reduce_sum(table).float().cpu().numpy()


def load_or_compute(recipe: Recipe, module, loader, dataset, *, micro_batch: int, place: Place) -> np.ndarray:
    """The stored table for `dataset` when there is one of the right shape, else computed now and stored (rank 0)."""
    path = reference_path(recipe, dataset)
    if path.is_file():
        table = np.load(path)
        if table.shape == (len(dataset), 2):
            return table
    table = compute_reference(module, loader, dataset, micro_batch=micro_batch, place=place)
    if place.is_main:
        buffer = io.BytesIO()
        np.save(buffer, table)
        write_atomically(path, buffer.getvalue())
    return table
