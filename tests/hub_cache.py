"""A Hugging Face Hub cache on disk, laid out as huggingface_hub lays it out, built from a local model directory.

    HF_HUB_CACHE/models--org--name/blobs/<sha256>          the files' bytes, once each
    HF_HUB_CACHE/models--org--name/snapshots/<commit>/F    a symlink to ../../blobs/<sha256>
    HF_HUB_CACHE/models--org--name/refs/main               the commit main names

`hub_cache` points huggingface_hub at it offline: the environment for child processes (torchrun's workers), and
huggingface_hub's constants for this process, which read the environment once at import.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import datasets
import pytest
from huggingface_hub import constants

SHAKESPEARE_MINI = Path(__file__).resolve().parents[1] / "memtrain" / "assets" / "models" / "shakespeare-mini"
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def add_snapshot(
    cache: Path, repo: str, source: Path, files: tuple[str, ...] = MODEL_FILES, ref: str = "main", salt: str = ""
) -> str:
    """Put `files` of `source` into the cache as a commit of `repo` that `ref` names; returns the commit."""
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha1(salt.encode())
    blobs = {}
    for name in files:
        data = (source / name).read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (repo_dir / "blobs" / blob).write_bytes(data)
        blobs[name] = blob
        digest.update(name.encode() + blob.encode())
    commit = digest.hexdigest()  # 40 hex digits, as a git commit id has
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, blob in blobs.items():
        link = snapshot / name
        if not link.exists():
            link.symlink_to(Path("..") / ".." / "blobs" / blob)
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / ref).write_text(commit)
    return commit


def add_dataset_snapshot(cache: Path, repo: str, files: dict[str, bytes], ref: str = "main") -> str:
    """Put `files` ({path in the repo: bytes}) into the cache as a commit of dataset `repo` that `ref` names."""
    repo_dir = cache / f"datasets--{repo.replace('/', '--')}"
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha1(b"dataset")
    for name, data in sorted(files.items()):
        digest.update(name.encode() + hashlib.sha256(data).hexdigest().encode())
    commit = digest.hexdigest()
    for name, data in files.items():
        blob = hashlib.sha256(data).hexdigest()
        (repo_dir / "blobs" / blob).write_bytes(data)
        link = repo_dir / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            link.symlink_to(Path(os.path.relpath(repo_dir / "blobs" / blob, link.parent)))
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / ref).write_text(commit)
    return commit


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hub cache that this process and its children read offline."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    # datasets' own cache (the Arrow files load_dataset converts a Hub dataset to), private to the test too
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    return cache
