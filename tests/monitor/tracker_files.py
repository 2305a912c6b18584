"""Reading back what the trackers wrote, from their own files: a W&B offline run's history (its .wandb log) and an
MLflow file store's metrics (one file per metric: `timestamp value step` lines)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

_BLOCK_BYTES = 32768  # the .wandb log is LevelDB's log format: 32 KiB blocks of records with 7-byte headers
_FULL, _LAST = 1, 4


def wandb_records(path: Path) -> list:
    """The protobuf records of a .wandb file (a record may span blocks: FIRST, MIDDLE..., LAST)."""
    from wandb.proto import wandb_internal_pb2  # noqa: PLC0415 — tests that read it import-skip without wandb

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, pending, records = 7, b"", []
    while pos + 7 <= len(data):
        left = _BLOCK_BYTES - pos % _BLOCK_BYTES
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(run_dir: Path) -> tuple[list[dict], dict, set[str]]:
    """(the logged rows of every offline W&B run file under run_dir/wandb, in order; the config; the run ids)."""
    rows, config, ids = [], {}, set()
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                rows.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
            elif kind == "run":
                ids.add(record.run.run_id)
                config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
    return rows, config, ids


def mlflow_metric(store: Path, name: str) -> dict[str, list[tuple[int, float]]]:
    """{run id: [(step, value), ...]} of one metric over the runs of an MLflow file store."""
    found = {}
    for path in store.glob(f"*/*/metrics/{name}"):
        lines = [line.split() for line in path.read_text().splitlines() if line.strip()]
        found[path.parents[len(Path(name).parts)].name] = [(int(step), float(value)) for _, value, step in lines]
    return found


def mlflow_params(store: Path, run_id: str) -> dict[str, str]:
    (run,) = store.glob(f"*/{run_id}")
    params = run / "params"
    return {str(p.relative_to(params)): p.read_text() for p in params.rglob("*") if p.is_file()}
