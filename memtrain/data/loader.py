"""Which samples each step sees (a resumable shuffled order) and getting them onto the device ahead of time."""
from __future__ import annotations

import functools
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch


class SampleOrder:
    """Maps a global sample cursor (samples consumed since the run began, over all epochs) to dataset indices.

    Each epoch is a fresh permutation from (seed, epoch); deterministic, so a resumed run sees the same
    samples in the same order.
    """

    def __init__(self, n_samples: int, seed: int):
        if n_samples < 1:
            raise ValueError(f"n_samples must be at least 1, got {n_samples}")
        self.n_samples = n_samples
        self.seed = seed

    def epoch_of(self, cursor: int) -> int:
        """The epoch (from 0) that sample number `cursor` belongs to."""
        if cursor < 0:
            raise ValueError(f"cursor must be >= 0, got {cursor}")
        return cursor // self.n_samples

    def permutation(self, epoch: int) -> np.ndarray:
        """Dataset indices in the order epoch `epoch` visits them."""
        return _permutation(self.n_samples, self.seed, epoch)

    def indices(self, start: int, count: int) -> list[int]:
        """Dataset indices of samples start .. start+count-1 of the run; may span epoch boundaries."""
        if start < 0 or count < 0:
            raise ValueError(f"start and count must be >= 0, got {start}, {count}")
        out: list[int] = []
        cursor, end = start, start + count
        while cursor < end:
            epoch, offset = divmod(cursor, self.n_samples)
            take = min(end - cursor, self.n_samples - offset)
            out.extend(self.permutation(epoch)[offset:offset + take].tolist())
            cursor += take
        return out


@functools.lru_cache(maxsize=4)
def _permutation(n_samples: int, seed: int, epoch: int) -> np.ndarray:
    # SeedSequence([seed, epoch]) gives independent, platform-stable streams per epoch.
    order = np.random.default_rng([seed, epoch]).permutation(n_samples)
    order.flags.writeable = False  # shared through the cache
    return order


def collate(dataset, indices: list[int]) -> dict[str, torch.Tensor]:
    """Stack dataset[i] for i in `indices` into one batch: each key becomes a [len(indices), ...] tensor."""
    items = [dataset[i] for i in indices]
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


class BatchLoader:
    """Collates dataset items into micro-batches on the training device with a background prefetch.

    On CUDA: pinned host tensors and non-blocking copies; on CPU: plain tensors. The background thread
    only builds host tensors; the copy to the device is issued in `get`, on the caller's stream, so it
    is ordered with the compute that uses it. `prefetch` is how many micro-batches may load ahead of
    `get` (0: every batch loads inside `get`); either call order, prefetch(next) then get(current) or
    get(current) then prefetch(next), finds its batch ready.
    """

    def __init__(self, dataset, device: torch.device, prefetch: int = 2):
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        self.dataset = dataset
        self.device = torch.device(device)
        self.max_pending = prefetch
        self._pin = self.device.type == "cuda"
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memtrain-prefetch")
        self._pending: OrderedDict[tuple[int, ...], Future] = OrderedDict()

    def prefetch(self, indices: list[int]) -> None:
        """Start loading this micro-batch in a background thread (no-op when prefetch is 0 or already queued)."""
        key = tuple(indices)
        if self.max_pending == 0 or key in self._pending:
            return
        self._pending[key] = self._pool.submit(self._host_batch, key)
        # `prefetch` batches ahead plus the one a caller queued just before asking for it; beyond that the
        # oldest goes first, so batches never asked for (the micro-batch size changed) do not pile up.
        while len(self._pending) > self.max_pending + 1:
            _, stale = self._pending.popitem(last=False)
            stale.cancel()

    def get(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """The micro-batch for `indices` on the device: the prefetched one if queued, else loaded now."""
        key = tuple(indices)
        if key in self._pending:
            # Batches queued before this one were skipped and will not be asked for.
            while (oldest := next(iter(self._pending))) != key:
                self._pending.pop(oldest).cancel()
        future = self._pending.pop(key, None)
        batch = future.result() if future is not None else self._host_batch(key)
        if self.device.type == "cpu":
            return batch
        return {name: tensor.to(self.device, non_blocking=self._pin) for name, tensor in batch.items()}

    def close(self) -> None:
        """Drop queued batches and stop the background thread."""
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _host_batch(self, key: tuple[int, ...]) -> dict[str, torch.Tensor]:
        batch = collate(self.dataset, list(key))
        if self._pin:
            batch = {name: tensor.pin_memory() for name, tensor in batch.items()}
        return batch
