"""The token cache: every document tokenised once, stored as a flat memory-mapped .npy per (data, tokenizer).

Two files per key: `<key>.tokens.npy` (all documents end to end, an eos after each) and
`<key>.doc_ends.npy` (the end offset of each document, so unpacked datasets need no eos scan).
The tokens file is written after the ends file; last comes `<key>.sums.json`, each file's size, sha256 and
modification time as written (hashed while it is written, so it costs no second read), the sign that an entry is
complete (`write_entry`, also for tokenized.py's entries).

Before an entry is used (`entry_problem`) each file's size is compared with the record, always; the bytes are hashed
again when the entry is small (FULL_HASH_BELOW_BYTES: ~0.1 s at sha256's ~650 MB/s) or when a file's modification
time is not the one recorded. Any write through the filesystem (a zero-fill, random bytes, a copy, a partial rewrite)
changes it, so a multi-GB entry left as written loads without reading all of it, and one that was touched is checked
whole. An entry that does not verify, or one without the record (an older memtrain's), is tokenised again with a
one-line note: it is derived data, so rebuilding is always right.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

from memtrain.data.read.corpus import read_documents, source_fingerprint
from memtrain.data.tokens.long_text import encode_documents
from memtrain.data.tokens.tokenizer import tokenizer_fingerprint
from memtrain.errors import Problem, UserError
from memtrain.files import atomic_path, leftovers_in, write_atomically

# Bump when the layout or the tokenisation rules below change, so old entries are not reused.
CACHE_VERSION = "1"
# A killed write's temporary this old is removed by the next write of its entry (np.save keeps a live one fresh).
STALE_S = 600
SUMS_SUFFIX = ".sums.json"  # an entry's record of its files' sizes and checksums, written last
FULL_HASH_BELOW_BYTES = 64 << 20  # entries smaller than this are hashed whole on every load
# What the check found damaged in this process, for messages that weigh a damaged input (a run's NaN / divergence)
_found_damaged: list[str] = []


def default_cache_dir() -> Path:
    """$MEMTRAIN_CACHE if set, else ~/.cache/memtrain/tokens."""
    env = os.environ.get("MEMTRAIN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "memtrain" / "tokens"


def cache_dir_of(cache_dir: str | None) -> Path:
    """The token cache a recipe's data.cache_dir names, else the default one."""
    return Path(cache_dir).expanduser() if cache_dir else default_cache_dir()


def token_dtype(tokenizer: PreTrainedTokenizerBase) -> type:
    """uint16 when every id fits, else uint32: how the cache stores tokens (and samples hold them while made)."""
    return np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.uint32


def cache_key(spec: str, fmt: str, field: str, tokenizer: PreTrainedTokenizerBase, directory: Path) -> str:
    """sha256 of the data's content fingerprint and the tokenizer's fingerprint."""
    parts = (CACHE_VERSION, source_fingerprint(spec, fmt, field, directory), tokenizer_fingerprint(tokenizer))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def cache_paths(
    spec: str, fmt: str, field: str, tokenizer: PreTrainedTokenizerBase, cache_dir: str | None
) -> tuple[Path, Path]:
    """(tokens file, document-ends file) for this data and tokenizer; they may not exist yet."""
    directory = cache_dir_of(cache_dir)
    key = cache_key(spec, fmt, field, tokenizer, directory)
    return directory / f"{key}.tokens.npy", directory / f"{key}.doc_ends.npy"


def cached_tokens(
    spec: str, fmt: str, field: str, tokenizer: PreTrainedTokenizerBase, cache_dir: str | None
) -> np.ndarray:
    """All documents of `spec` as one flat token array (eos after each), memory-mapped read-only.

    Tokenises on the first call and stores the result under `cache_dir` (default: $MEMTRAIN_CACHE or
    ~/.cache/memtrain/tokens); later calls with the same file content and tokenizer load it without
    tokenising. dtype is uint16 when every id fits, else uint32.
    """
    tokens_path, _ = _ensure(spec, fmt, field, tokenizer, cache_dir)
    return np.load(tokens_path, mmap_mode="r")


def cached_documents(
    spec: str, fmt: str, field: str, tokenizer: PreTrainedTokenizerBase, cache_dir: str | None
) -> tuple[np.ndarray, np.ndarray]:
    """(`cached_tokens(...)`, end offset of each document in it as int64), fingerprinting the data once."""
    tokens_path, ends_path = _ensure(spec, fmt, field, tokenizer, cache_dir)
    return np.load(tokens_path, mmap_mode="r"), np.load(ends_path)


def tokenize_documents(
    spec: str, fmt: str, field: str, tokenizer: PreTrainedTokenizerBase
) -> tuple[np.ndarray, np.ndarray]:
    """Tokenise every document of `spec` in batches: (flat tokens with eos after each, document end offsets).
    A long document goes to the tokenizer in pieces that tokenise as the whole does (long_text.py)."""
    dtype = token_dtype(tokenizer)
    eos = np.asarray([tokenizer.eos_token_id], dtype=dtype)
    chunks: list[np.ndarray] = []
    lengths: list[int] = []
    for ids in encode_documents(read_documents(spec, fmt, field), tokenizer, f"tokenising {Path(spec).name}"):
        chunks += [ids.astype(dtype), eos]
        lengths.append(len(ids) + 1)
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)
    return tokens, np.cumsum(np.asarray(lengths, dtype=np.int64))


# ---------------------------------------------------------------- storage


def _ensure(spec, fmt, field, tokenizer, cache_dir) -> tuple[Path, Path]:
    tokens_path, ends_path = cache_paths(spec, fmt, field, tokenizer, cache_dir)
    if _complete(tokens_path, ends_path):
        return tokens_path, ends_path
    tokens, ends = tokenize_documents(spec, fmt, field, tokenizer)
    write_entry([(ends_path, ends), (tokens_path, tokens)])  # a present tokens file always has its ends file beside it
    return tokens_path, ends_path


def _complete(tokens_path: Path, ends_path: Path) -> bool:
    """Both files exist, verify and load; a damaged entry (disk full, manual edits) counts as missing."""
    if not verified_entry([tokens_path, ends_path]):
        return False
    try:
        tokens = np.load(tokens_path, mmap_mode="r")
        ends = np.load(ends_path, mmap_mode="r")
    except (OSError, ValueError):
        return False
    return len(ends) > 0 and int(ends[-1]) == len(tokens)


def sums_path(path: Path) -> Path:
    """The record of sizes and checksums of the entry `path` (`<key>.<name>`) belongs to."""
    return path.with_name(path.name.split(".", 1)[0] + SUMS_SUFFIX)


def verified_entry(paths: list[Path]) -> bool:
    """Whether the entry of `paths` is there and verifies (`entry_problem`); when some of it is there but it does
    not verify, a line says so and that it is tokenised again (the caller rebuilds it)."""
    if not any(path.exists() for path in [*paths, sums_path(paths[0])]):
        return False  # never written: nothing to say
    problem = entry_problem(paths)
    if problem is not None:
        _found_damaged.append(f"{paths[0].parent / paths[0].name.split('.', 1)[0]}: {problem}")
        print(
            f"! token cache entry {paths[0].name.split('.', 1)[0][:12]}… in {paths[0].parent} {problem}: "
            "tokenising the data again",
            file=sys.stderr,
            flush=True,
        )
    return problem is None


def damaged_entries() -> tuple[str, ...]:
    """The cache entries this process found damaged (and tokenised again): `<dir>/<key>: what was wrong`."""
    return tuple(_found_damaged)


def entry_problem(paths: list[Path]) -> str | None:
    """Why the entry holding `paths` cannot be used, said for people, or None when it verifies (see the module doc)."""
    record = sums_path(paths[0])
    try:
        listed = {
            name: (int(entry["bytes"]), str(entry["sha256"]), int(entry["mtime_ns"]))
            for name, entry in json.loads(record.read_text()).items()
        }
    except FileNotFoundError:
        return "has no record of its checksums (written by an older memtrain, or its write was killed)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"has an unreadable {record.name}"
    missing = [path.name for path in paths if path.name not in listed]
    if missing:
        return f"has no checksum of {missing[0]}"
    stats = {}
    for name, (size, _, _) in listed.items():
        try:
            stats[name] = (record.parent / name).stat()
        except OSError:
            return f"is missing {name}"
        if stats[name].st_size != size:
            return f"holds {stats[name].st_size:,} bytes in {name}, {size:,} were written"
    whole = sum(size for size, _, _ in listed.values()) < FULL_HASH_BELOW_BYTES
    for name, (_, digest, mtime_ns) in listed.items():
        if (whole or stats[name].st_mtime_ns != mtime_ns) and _sha256(record.parent / name) != digest:
            return f"holds other bytes in {name} than were written (its checksum differs)"
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def write_entry(files: list[tuple[Path, np.ndarray | str]]) -> None:
    """Write a cache entry's files in order, then the record of their sizes and checksums (`sums_path`), which marks
    the entry complete; each file is whole or absent.

    Temporaries that killed writes left in the cache (of any entry) go first, once older than STALE_S, so a write
    under way in another process is left alone. When a file cannot be written, the entry's files written so
    far are removed and a UserError says why: a full disk (with the entry's size), no permission, or else."""
    directory = files[0][0].parent
    written: list[Path] = []
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # what killed writes left, of this entry or another one (a write of data since changed is never redone)
        for stale in leftovers_in(directory):
            with contextlib.suppress(OSError):
                if time.time() - stale.stat().st_mtime > STALE_S:
                    stale.unlink()
        sums = {}
        for path, content in files:
            if isinstance(content, str):
                write_atomically(path, content)
                digest = hashlib.sha256(content.encode()).hexdigest()
            else:
                digest = save_atomic(path, content)
            written.append(path)
            stat = path.stat()
            sums[path.name] = {"bytes": stat.st_size, "sha256": digest, "mtime_ns": stat.st_mtime_ns}
        record = sums_path(files[0][0])
        write_atomically(record, json.dumps(sums, indent=1))
        written.append(record)
    except (OSError, UserError) as err:
        for path in written:
            path.unlink(missing_ok=True)
        raise UserError(_unwritable(directory, err, files)) from None


def _unwritable(directory: Path, err: OSError | UserError, files: list[tuple[Path, np.ndarray | str]]) -> Problem:
    # the OSError itself, or the one behind atomic_path's UserError (raised while handling it)
    cause = (
        err
        if isinstance(err, OSError)
        else next((e for e in (err.__cause__, err.__context__) if isinstance(e, OSError)), None)
    )
    entry_bytes = sum(c.nbytes if isinstance(c, np.ndarray) else len(c) for _, c in files)
    # numpy says a short write as "N requested and M written", with no errno: the room left tells then
    if isinstance(cause, OSError) and (cause.errno in (errno.ENOSPC, errno.EDQUOT) or _room(directory) < entry_bytes):
        return Problem(
            f"cannot write the token cache in {directory}: its filesystem is full (this entry needs "
            f"{entry_bytes / 2**20:.0f} MB)",
            key="data.cache_dir",
            hint="free some space there, or set data.cache_dir (or $MEMTRAIN_CACHE) to a filesystem with "
            "room; the data is tokenised again on the next start",
        )
    if isinstance(cause, PermissionError):
        return Problem(
            f"cannot write the token cache in {directory}: no permission",
            key="data.cache_dir",
            hint="set data.cache_dir (or $MEMTRAIN_CACHE) to a directory you can write to",
        )
    reason = (cause.strerror or str(cause)) if isinstance(cause, OSError) else str(err)
    return Problem(
        f"cannot write the token cache in {directory}: {reason}",
        key="data.cache_dir",
        hint="set data.cache_dir (or $MEMTRAIN_CACHE) to a writable directory",
    )


def _room(directory: Path) -> float:
    """Bytes free on `directory`'s filesystem (infinite when that cannot be asked)."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return float("inf")


def save_atomic(path: Path, array: np.ndarray) -> str:
    """Readers see all of the array or nothing (np.save to a path would also append .npy to the temporary name).
    Returns the sha256 of the file's bytes, hashed as they are written."""
    with atomic_path(path) as tmp, open(tmp, "wb") as handle:
        hashing = _Hashing(handle)
        np.save(hashing, array)
    return hashing.digest.hexdigest()


class _Hashing:
    """A file that hashes what is written to it (np.save then writes in 16 MiB chunks through `write`)."""

    def __init__(self, handle):
        self.handle, self.digest = handle, hashlib.sha256()

    def write(self, data) -> int:
        self.digest.update(data)
        return self.handle.write(data)
