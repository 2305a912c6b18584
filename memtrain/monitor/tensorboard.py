"""Optional TensorBoard event files beside metrics.jsonl (`pip install memtrain[tensorboard]`).

torch.utils.tensorboard needs the `tensorboard` package; without it there is no writer and the run
goes on with metrics.jsonl alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Fields that are bookkeeping, not curves.
_NOT_SCALARS = {"kind", "step", "time"}


class TensorBoardWriter:
    """Writes every numeric field of a metrics record as the scalar `<kind>/<field>` at its step."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def add(self, record: dict[str, Any]) -> None:
        """Add one host-side record (numbers only; strings, nulls and paths are left to metrics.jsonl)."""
        step = int(record["step"])
        walltime = record.get("time")
        for name, value in record.items():
            if name in _NOT_SCALARS or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            self._writer.add_scalar(f"{record['kind']}/{name}", value, global_step=step, walltime=walltime)

    def flush(self) -> None:
        """Hand what is written to the OS."""
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()


def tensorboard_available() -> bool:
    """Whether the `tensorboard` package that torch.utils.tensorboard needs is installed."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def open_tensorboard(log_dir: Path) -> TensorBoardWriter | None:
    """A writer into `log_dir`, or None (silently) when the `tensorboard` package is not installed."""
    if not tensorboard_available():
        return None
    return TensorBoardWriter(log_dir)
