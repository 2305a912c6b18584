"""The run's metrics log: metrics.jsonl, one JSON record per line, appended as the run goes.

Values may be 0-dim tensors still on the GPU. Reading one (`.item()`) waits for the GPU to finish
everything queued before it, so calling it every step costs real speed. `MetricsLog` keeps them as
tensors and converts all that are buffered in one transfer per flush (stack + tolist), so logging adds
no host-device sync per step. Every line is complete on its own and handed to the OS at once, so a run
killed at any moment leaves a file that `read_metrics` can still read.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from memtrain.monitor.tensorboard import TensorBoardWriter, open_tensorboard
from memtrain.monitor.trackers import Tracker

METRICS_FILE = "metrics.jsonl"
GENERATION_KIND = "generation"  # the record of a generation evaluation (train/eval/generation.py): exact match


class MetricsLog:
    """Append-only metrics.jsonl in the run directory, buffered so that GPU scalars cost no per-step sync.

    `record` buffers (flushed every `flush_every` "train" records), `event` writes at once (after any
    buffered records, so the file stays in order). With `enabled=False` (ranks other than 0) every call
    is a no-op. Non-finite floats are written as null: JSON has no NaN. `trackers` (monitor/trackers.py) receive
    every record as it is written, and are closed with the log.
    """

    def __init__(
        self,
        path: Path,
        flush_every: int,
        tensorboard_dir: Path | None = None,
        enabled: bool = True,
        trackers: Sequence[Tracker] = (),
    ):
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        self.path = Path(path)
        self.flush_every = flush_every
        self.enabled = enabled
        self._pending: list[dict[str, Any]] = []
        self._pending_train = 0
        self.last_flushed: dict[str, Any] | None = None  # the newest "train" record written, host values
        self._file = None
        self._tensorboard: TensorBoardWriter | None = None
        self._trackers = list(trackers) if enabled else []
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        needs_newline = self.path.exists() and self.path.stat().st_size > 0 and _last_byte(self.path) != b"\n"
        # Line-buffered: each record reaches the OS as soon as its newline is written.
        self._file = open(self.path, "a", encoding="utf-8", buffering=1)
        if needs_newline:
            # A killed run left half a line; end it so our first record is not glued onto it.
            self._file.write("\n")
        if tensorboard_dir is not None:
            self._tensorboard = open_tensorboard(Path(tensorboard_dir))

    @property
    def pending(self) -> list[dict[str, Any]]:
        """Records buffered since the last flush, values as given (tensors stay tensors)."""
        return list(self._pending)

    def record(self, kind: str, step: int, **values: Any) -> None:
        """Buffer one record; every `flush_every`-th "train" record flushes the buffer."""
        if not self.enabled:
            return
        self._pending.append(_new_record(kind, step, values))
        if kind == "train":
            self._pending_train += 1
            if self._pending_train >= self.flush_every:
                self.flush()

    def event(self, kind: str, step: int, **values: Any) -> None:
        """Write one record now (batch changes, OOMs, run start/end, eval), after what is buffered."""
        if not self.enabled:
            return
        self._pending.append(_new_record(kind, step, values))
        self.flush()

    def flush(self) -> None:
        """Convert buffered tensors in one host transfer per device and append the records to the file."""
        if not self.enabled or not self._pending:
            return
        records = _to_host(self._pending)
        self._pending = []
        self._pending_train = 0
        for record in records:
            self._file.write(json.dumps(record, allow_nan=False, default=_json_default) + "\n")
            if record["kind"] == "train":
                self.last_flushed = record
        if self._tensorboard is not None:
            for record in records:
                self._tensorboard.add(record)
        for tracker in list(self._trackers):
            try:
                tracker.write(records)
            except Exception as error:  # noqa: BLE001 — a tracker mirrors metrics.jsonl: losing it must not stop a run
                self._trackers.remove(tracker)
                print(
                    f"! {type(tracker).__name__} stopped receiving metrics ({type(error).__name__}: "
                    f"{str(error).splitlines()[0] if str(error) else ''}); metrics.jsonl keeps every record",
                    file=sys.stderr,
                )

    def close(self) -> None:
        """Flush what is buffered and close the file and the TensorBoard writer."""
        if not self.enabled or self._file is None:
            return
        self.flush()
        self._file.close()
        self._file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        for tracker in self._trackers:
            tracker.close()
        self._trackers = []

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def read_metrics(path: Path) -> list[dict]:
    """All complete records of a metrics.jsonl, in file order; a torn line (killed run) is skipped."""
    return read_metrics_counted(path)[0]


def read_metrics_counted(path: Path) -> tuple[list[dict], int]:
    """The records of a metrics.jsonl and how many lines could not be read (read_metrics_lines)."""
    records, bad_lines = read_metrics_lines(path)
    return records, len(bad_lines)


def read_metrics_lines(path: Path) -> tuple[list[dict], list[int]]:
    """The records of a metrics.jsonl and the numbers (from 1) of the lines that are not records.

    A run killed mid-write leaves a torn last line; after a resume that line sits in the middle of the
    file, so unreadable lines are skipped wherever they are. A line that is JSON but not a record memtrain
    wrote (no kind, a step that is not a whole number) is skipped too: a report reads every step as a number.
    """
    records: list[dict] = []
    bad_lines: list[int] = []
    with open(path, "rb") as file:
        for number, raw in enumerate(file, start=1):
            text = raw.strip()
            if not text:
                continue
            try:
                record = json.loads(text)
            except (json.JSONDecodeError, UnicodeDecodeError):
                bad_lines.append(number)
                continue
            if is_record(record):
                records.append(record)
            else:
                bad_lines.append(number)
    return records, bad_lines


def is_record(record: object) -> bool:
    """A metrics record as MetricsLog writes it: a kind (text) and a step (a whole number, 0 or more)."""
    if not isinstance(record, dict):
        return False
    step = record.get("step")
    return isinstance(record.get("kind"), str) and isinstance(step, int) and not isinstance(step, bool) and step >= 0


def _new_record(kind: str, step: int, values: dict[str, Any]) -> dict[str, Any]:
    for name, value in values.items():
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise ValueError(f"metric {kind}.{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
    return {"kind": kind, "step": int(step), "time": time.time(), **values}


def _to_host(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of `records` with every tensor replaced by a Python number: one stack + tolist per device."""
    slots_by_device: dict[torch.device, list[tuple[int, str, torch.Tensor]]] = {}
    for index, record in enumerate(records):
        for name, value in record.items():
            if isinstance(value, torch.Tensor):
                slots_by_device.setdefault(value.device, []).append((index, name, value))
    converted = [dict(record) for record in records]
    for slots in slots_by_device.values():
        # float64 holds every integer count below 2**53 exactly, and every float32/bf16 value.
        stacked = torch.stack([tensor.detach().reshape(()).to(torch.float64) for _, _, tensor in slots])
        for (index, name, tensor), number in zip(slots, stacked.tolist()):
            is_integer = not (tensor.is_floating_point() or tensor.is_complex())
            converted[index][name] = int(number) if is_integer else number
    for record in converted:
        for name, value in record.items():
            if isinstance(value, float) and not math.isfinite(value):
                record[name] = None
    return converted


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    raise TypeError(f"metric value {value!r} of type {type(value).__name__} cannot be written as JSON")


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as file:
        file.seek(-1, 2)
        return file.read(1)
