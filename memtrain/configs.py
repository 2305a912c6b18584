"""Model shape presets (configs/models) and GPU profiles (configs/gpus)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import yaml

from memtrain.units import GiB, parse_bytes

CONFIGS_DIR = Path(os.environ.get("MEMTRAIN_CONFIGS", Path(__file__).resolve().parents[1] / "configs"))


def _names(kind: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS_DIR / kind).glob("*.yaml"))


def model_preset_names() -> list[str]:
    return _names("models")


def gpu_profile_names() -> list[str]:
    return _names("gpus")


@lru_cache(maxsize=None)
def model_preset(name: str) -> dict:
    """The Hugging Face config dict of a shape preset (model_type plus its fields)."""
    path = CONFIGS_DIR / "models" / f"{name}.yaml"
    if not path.is_file():
        raise KeyError(name)
    return yaml.safe_load(path.read_text())


@dataclass(frozen=True)
class GpuProfile:
    key: str
    name: str
    memory_bytes: int
    pcie_gbps: float | None = None
    bf16: bool = True
    cuda_context_bytes: int = int(0.6 * GiB)  # measured on the H200; a card given only by size gets this


def allocator_budget_bytes(card_bytes: int, cuda_context_bytes: int) -> int:
    """What PyTorch's allocator may reserve on a card: the card less the CUDA context and library workspaces,
    which live outside the allocator (1.3 GiB seen by nvidia-smi on the H200 beside 22.72 GiB reserved).
    The plan's verdict and the emulated cap (`hardware.cap_memory`) both use this, so they agree."""
    return max(int(card_bytes) - int(cuda_context_bytes), 0)


@lru_cache(maxsize=None)
def gpu_profile(spec: str) -> GpuProfile:
    """A GPU profile by name (configs/gpus/NAME.yaml) or an anonymous card of a given size ('24GiB')."""
    path = CONFIGS_DIR / "gpus" / f"{spec}.yaml"
    if path.is_file():
        raw = yaml.safe_load(path.read_text())
        return GpuProfile(
            key=spec,
            name=raw.get("name", spec),
            memory_bytes=parse_bytes(raw["memory"]),
            pcie_gbps=raw.get("pcie_gbps"),
            bf16=bool(raw.get("bf16", True)),
            cuda_context_bytes=parse_bytes(raw.get("cuda_context", int(0.6 * GiB))),
        )
    memory = parse_bytes(spec)  # raises ValueError for neither a profile nor a size
    return GpuProfile(key=spec, name=f"{spec} card", memory_bytes=memory)
