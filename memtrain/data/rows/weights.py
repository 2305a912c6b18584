"""How many times each sample of a dataset appears in an epoch, from its weight; and the held-out tail.

A weight w gives round(w x n) samples of a dataset of n: floor of that many whole copies, then a subset
of the rest drawn with the run's seed. The draw is made once, so every epoch (and a resumed run) sees
the same samples; `SampleOrder` only changes their order.
"""

from __future__ import annotations

import numpy as np

# Mixed into the seed so this draw is independent of the other seeded streams (sample order, dropout).
MIX_STREAM = 0x6D6978


def weighted_indices(n_samples: int, weight: float, seed: int, dataset: int) -> np.ndarray:
    """Indices into a dataset of `n_samples`, round(weight * n_samples) of them, sorted.

    `dataset` (its position in the recipe's list) keeps the subsets of different datasets independent.
    """
    if weight <= 0:
        raise ValueError(f"weight must be > 0, got {weight}")
    count = int(round(weight * n_samples))
    repeats, rest = divmod(count, n_samples) if n_samples else (0, 0)
    rng = np.random.default_rng([seed, dataset, MIX_STREAM])
    subset = np.sort(rng.choice(n_samples, size=rest, replace=False)) if rest else np.zeros(0, dtype=np.int64)
    return np.sort(np.concatenate([np.tile(np.arange(n_samples, dtype=np.int64), repeats), subset]))


def held_out_tail(n_samples: int, fraction: float) -> int:
    """Samples at the end of a dataset kept for validation: max(1, round(fraction * n)), as the text path does."""
    return max(1, int(round(fraction * n_samples)))
