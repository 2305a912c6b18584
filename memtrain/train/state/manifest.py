"""A checkpoint's manifest: every file's size and checksum, written when the checkpoint is saved, checked before a
resume trusts it.

The checksum is sha256 over 16 MiB blocks: each block is hashed on its own (threads: hashlib releases the GIL, so
the blocks of a multi-GB model-states file are hashed on every core), and the file's checksum is the sha256 of its
blocks' digests. sha256 over blake2b: with the CPU's SHA instructions it runs at ~650 MB/s per core on this
machine's CPU against blake2b's ~350 MB/s.

The manifest is written last (after the state file) and atomically (files.write_atomically), so a save killed
before it leaves no manifest, never one that lies; a checkpoint without one is either from an older memtrain or
a save that never finished (checkpoint.py tells which).
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from memtrain.files import write_atomically

MANIFEST_FILE = "memtrain_manifest.json"
CHECKSUM = "sha256-16MiB-blocks"  # the name the manifest records, so another scheme can be told apart
BLOCK_BYTES = 16 << 20
_THREADS = max(1, min(8, os.cpu_count() or 1))


def write_manifest(directory: Path) -> dict[str, dict]:
    """Hash every file under `directory` (the manifest itself left out) and write the manifest; returns it."""
    directory = Path(directory)
    files = _files(directory)
    sums = _checksums(files)
    manifest = {
        "checksum": CHECKSUM,
        "files": {
            path.relative_to(directory).as_posix(): {"bytes": path.stat().st_size, "sha256": digest}
            for path, digest in zip(files, sums)
        },
    }
    write_atomically(directory / MANIFEST_FILE, json.dumps(manifest, indent=1))
    return manifest["files"]


def has_manifest(directory: Path) -> bool:
    return (Path(directory) / MANIFEST_FILE).is_file()


def manifest_problem(directory: Path) -> str | None:
    """Why the files of `directory` are not those its manifest lists (a missing file, another size, other bytes);
    None when they are. Sizes are compared first: a truncated file costs no hashing."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
        listed = {name: (int(entry["bytes"]), str(entry["sha256"])) for name, entry in manifest["files"].items()}
        if manifest.get("checksum") != CHECKSUM:
            return f"its {MANIFEST_FILE} uses a checksum this memtrain does not know ({manifest.get('checksum')})"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"its {MANIFEST_FILE} is not readable"
    for name, (size, _) in sorted(listed.items()):
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        found = path.stat().st_size
        if found != size:
            return f"{name} holds {found:,} bytes, {size:,} were saved"
    names = sorted(listed)
    for name, digest in zip(names, _checksums([directory / name for name in names])):
        if digest != listed[name][1]:
            return f"{name} holds other bytes than were saved (its checksum differs)"
    return None


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def _checksums(files: list[Path]) -> list[str]:
    """Each file's checksum (see the module doc), the blocks of all files hashed together on a few threads."""
    blocks = [(i, offset) for i, path in enumerate(files) for offset in range(0, path.stat().st_size, BLOCK_BYTES)]
    with ThreadPoolExecutor(_THREADS) as pool:
        digests = list(pool.map(lambda block: _block_digest(files[block[0]], block[1]), blocks))
    per_file: list[hashlib._Hash] = [hashlib.sha256() for _ in files]
    for (i, _), digest in zip(blocks, digests):
        per_file[i].update(digest)
    return [h.hexdigest() for h in per_file]


def _block_digest(path: Path, offset: int) -> bytes:
    with open(path, "rb") as handle:
        return hashlib.sha256(os.pread(handle.fileno(), BLOCK_BYTES, offset)).digest()
