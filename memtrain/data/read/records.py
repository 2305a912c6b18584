"""Reading records (one JSON-like mapping per sample) from .jsonl, .json, .parquet, Hugging Face datasets directories,
and Hub datasets (`hub:org/name`: the repo's snapshot in huggingface_hub's cache, read by datasets.load_dataset, which
converts it to memory-mapped Arrow once, in its own cache).

Every reader yields `(number, record)`: `number` is where a person finds the record — the line of a JSONL
file, else the record's 1-based position (the JSON list's item, the parquet or datasets row + 1). Problems
name the file and that number, are collected and raised together as one `DataError` after the last record
(data/read/problems.py), so a caller that consumes the records must not keep anything before the end. A caller that
finds problems of its own in the records (bad fields) passes its `FileProblems` in: the file's problems then
go there, in line order with the caller's, and the caller raises them all.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import zlib
from collections.abc import Iterator
from pathlib import Path

from memtrain.data.read.corpus import ASSETS, builtin_corpus_names, json_kind, resolve_path
from memtrain.data.read.file_memo import remembered_fingerprint
from memtrain.data.read.problems import FileProblems
from memtrain.errors import DataError, Problem
from memtrain.files import digest_file
from memtrain.hub import commit_of, dataset_dir, hub_repo
from memtrain.recipe.schema import BUILTIN_PREFIX

BUILTIN_DIR = ASSETS / "chat"
# The bundled record datasets by name: the synthetic chat data (synthetic.py) and its preference pairs
# (synthetic_pairs.py); each directory holds train.jsonl and its other splits.
BUILTIN_DATASETS = {"chat": BUILTIN_DIR, "preference": ASSETS / "preference"}
# Record files by extension (after an optional .gz); a directory is a datasets save_to_disk directory.
RECORD_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}
TEXT_SUFFIXES = (".txt", ".text", ".md")  # also the bundled corpora, .txt.gz
# Rows handed from parquet / Arrow to Python at a time: bounded memory on large files.
ROWS_PER_BATCH = 1024

Record = tuple[int, dict]


def builtin_dataset_names() -> list[str]:
    """'chat' (its train split) and 'chat/validation': the bundled synthetic chat data; 'preference' and
    'preference/validation': its preference pairs."""
    names = []
    for name, directory in BUILTIN_DATASETS.items():
        for split in sorted(directory.glob("*.jsonl")):
            names.append(name if split.stem == "train" else f"{name}/{split.stem}")
    return names


def resolve_dataset_path(spec: str) -> Path:
    """The file or directory behind a dataset's `path`: 'builtin:chat[/SPLIT]' maps to the bundled chat data,
    'builtin:shakespeare[/SPLIT]' to the bundled text corpus, 'hub:org/name' to the dataset repo's snapshot (from
    the Hub cache, downloaded into it when it is not there), anything else is a path."""
    if hub_repo(spec):
        return dataset_dir(spec)
    if not spec.startswith(BUILTIN_PREFIX):
        return Path(spec).expanduser()
    name = spec[len(BUILTIN_PREFIX) :]
    if name in builtin_corpus_names():
        return resolve_path(spec)
    if name not in builtin_dataset_names():
        raise DataError(
            Problem(
                f"there is no builtin dataset {name!r}",
                file=spec,
                hint="use one of "
                + ", ".join(BUILTIN_PREFIX + n for n in builtin_dataset_names() + builtin_corpus_names())
                + ", or a path",
            )
        )
    dataset, _, split = name.partition("/")
    return BUILTIN_DATASETS[dataset] / f"{split or 'train'}.jsonl"


def record_format(spec: str) -> str:
    """'jsonl' | 'json' | 'parquet' | 'datasets' (a save_to_disk directory) | 'hub' | 'text' for `spec`, by its
    extension."""
    if hub_repo(spec):
        return "hub"
    path = resolve_dataset_path(spec)
    if path.is_dir():
        return "datasets"
    if not path.exists():
        raise DataError(
            Problem(
                f"cannot read {path}: no such file or directory",
                file=spec,
                hint="check the path in the recipe (relative paths start at the working directory)",
            )
        )
    name = path.name.lower()
    if name.endswith(".gz"):
        name = name[: -len(".gz")]
    suffix = Path(name).suffix
    if suffix in RECORD_SUFFIXES:
        return RECORD_SUFFIXES[suffix]
    if suffix in TEXT_SUFFIXES:
        return "text"
    raise DataError(
        Problem(
            f"cannot tell the format of {path.name}",
            file=spec,
            hint="use a .jsonl, .json, .parquet or .txt file, or a directory written by datasets' save_to_disk",
        )
    )


def read_records(
    spec: str, split: str | None = None, problems: FileProblems | None = None, subset: str | None = None
) -> Iterator[Record]:
    """Yield (number, record) for every record of `spec`; blank JSONL lines are skipped.

    Raises `DataError` naming file and line/record for an unreadable or damaged file, invalid JSON, or an item
    that is not an object (after the last record; with `problems` given, those go there for the caller to
    raise). `split` picks one split of a datasets directory that holds several (or of a Hub dataset, and `subset`
    its subset).
    """
    kind = record_format(spec)
    if kind == "hub":
        yield from _read_hub(spec, split, subset)
        return
    path = resolve_dataset_path(spec)
    found = problems if problems is not None else FileProblems(spec)
    if kind == "jsonl":
        yield from _read_jsonl(spec, path, found)
    elif kind == "json":
        yield from _read_json(spec, path, found)
    elif kind == "parquet":
        yield from _read_parquet(spec, path)
    elif kind == "datasets":
        yield from _read_datasets_dir(spec, path, split)
    else:
        raise DataError(
            Problem(
                f"{path.name} is plain text, which holds no records", file=spec, hint="use type: text for a text file"
            )
        )
    if problems is None:
        found.raise_if_any()


def dataset_fingerprint(
    spec: str, split: str | None = None, memo_root: Path | None = None, subset: str | None = None
) -> str:
    """sha256 over the bytes of the file (or of every file of a directory, with their names) and the split;
    hashed once per version of the files when `memo_root` (the token cache) is given (file_memo.py). A Hub dataset's
    is its commit's, with the subset and split: the Hub names its bytes by it."""
    path = resolve_dataset_path(spec)
    if hub_repo(spec):
        key = f"hub\0{hub_repo(spec)}\0{commit_of(path) or path}\0subset={subset}\0split={split}"
        return hashlib.sha256(key.encode()).hexdigest()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]

    def compute() -> str:
        digest = hashlib.sha256()
        try:
            for file in files:
                digest.update(f"\0{file.relative_to(path) if path.is_dir() else ''}\0".encode())
                digest_file(digest, file)
        except OSError as err:
            raise _unreadable(spec, path, err) from None
        digest.update(f"\0split={split}".encode())
        return digest.hexdigest()

    return remembered_fingerprint(files, f"records\0{path}\0split={split}", compute, memo_root)


# ---------------------------------------------------------------- readers


def _unreadable(spec: str, path: Path, err: Exception) -> DataError:
    reason = getattr(err, "strerror", None) or str(err)
    return DataError(
        Problem(
            f"cannot read {path}: {reason}",
            file=spec,
            hint="check the path in the recipe (relative paths start at the working directory)",
        )
    )


def _open_binary(spec: str, path: Path):
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        return opener(path, "rb")
    except OSError as err:
        raise _unreadable(spec, path, err) from None


def _read_jsonl(spec: str, path: Path, problems: FileProblems) -> Iterator[Record]:
    with _open_binary(spec, path) as handle:
        line_no = 0
        try:
            for line_no, raw in enumerate(handle, start=1):
                if line_no == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]
                if not raw.strip():
                    continue
                record = _parse_jsonl_line(spec, raw, line_no, problems)
                if record is not None:
                    # Good records still go out after a bad line, so that one run reports the problems of
                    # both kinds (bad JSON here, bad fields where they are read); the error comes at the end.
                    yield line_no, record
        except (OSError, EOFError, zlib.error) as err:
            raise DataError(
                Problem(
                    f"cannot read past line {line_no}: {err}",
                    file=spec,
                    line=line_no + 1,
                    hint="the file is damaged or truncated; recreate it",
                )
            ) from None


def _parse_jsonl_line(spec: str, raw: bytes, line_no: int, problems: FileProblems) -> dict | None:
    """The record on one line, or None (its problem added to `problems`)."""
    try:
        record = json.loads(raw)
    except UnicodeDecodeError:
        problems.add(Problem("the line is not UTF-8 text", file=spec, line=line_no, hint="convert the file to UTF-8"))
        return None
    except json.JSONDecodeError as err:
        problems.add(
            Problem(
                f"invalid JSON: {err.msg} (column {err.colno})",
                file=spec,
                line=line_no,
                hint="each line must be one JSON object",
            )
        )
        return None
    if not isinstance(record, dict):
        problems.add(
            Problem(
                f"the line holds {json_kind(record)}, not an object",
                file=spec,
                line=line_no,
                hint="write each line as one JSON object of fields",
            )
        )
        return None
    return record


def _read_json(spec: str, path: Path, problems: FileProblems) -> Iterator[Record]:
    with _open_binary(spec, path) as handle:
        try:
            raw = handle.read()
        except (OSError, EOFError, zlib.error) as err:
            raise _unreadable(spec, path, err) from None
    try:
        items = json.loads(raw)
    except UnicodeDecodeError:
        raise DataError(Problem("the file is not UTF-8 text", file=spec, hint="convert the file to UTF-8")) from None
    except json.JSONDecodeError as err:
        raise DataError(
            Problem(
                f"invalid JSON: {err.msg} (column {err.colno})",
                file=spec,
                line=err.lineno,
                hint="a .json dataset is one JSON list of objects; use .jsonl for one per line",
            )
        ) from None
    if not isinstance(items, list):
        raise DataError(
            Problem(
                f"the file holds {json_kind(items)}, not a list of records",
                file=spec,
                hint="write the records as one JSON list: [{...}, {...}]",
            )
        )
    for number, item in enumerate(items, start=1):
        if isinstance(item, dict):
            yield number, item
        else:
            problems.add(
                Problem(
                    f"record {number} is {json_kind(item)}, not an object",
                    file=spec,
                    line=number,
                    hint="every item of the list must be an object of fields",
                )
            )


def _read_parquet(spec: str, path: Path) -> Iterator[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as err:
        raise DataError(
            Problem(
                f"cannot read {path} as parquet: {err}",
                file=spec,
                hint="check that the file is a complete parquet file",
            )
        ) from None
    number = 0
    for batch in parquet.iter_batches(batch_size=ROWS_PER_BATCH):
        for record in batch.to_pylist():
            number += 1
            yield number, record


def _read_hub(spec: str, split: str | None, subset: str | None) -> Iterator[Record]:
    """A Hub dataset's split, through datasets.load_dataset on the repo's cached snapshot (its parquet, JSON or CSV
    files, splits by their names or the card's configs), as memory-mapped Arrow in datasets' cache."""
    import datasets

    snapshot = resolve_dataset_path(spec)
    try:
        loaded = datasets.load_dataset(str(snapshot), subset, split=split or "train")
    except (ValueError, FileNotFoundError, OSError, datasets.exceptions.DatasetGenerationError) as err:
        raise DataError(
            Problem(
                f"cannot load Hub dataset {hub_repo(spec)} (subset {subset}, split {split or 'train'}): "
                f"{str(err).splitlines()[0] if str(err) else type(err).__name__}",
                file=spec,
                key="split",
                hint="set the dataset's split: and subset: to ones the dataset has (its card on the Hub lists them)",
            )
        ) from None
    yield from _rows(loaded)


def _rows(loaded) -> Iterator[Record]:
    """(row + 1, record) of a datasets Dataset, read in batches of ROWS_PER_BATCH."""
    number = 0
    for batch in loaded.iter(batch_size=ROWS_PER_BATCH):
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns)):
            number += 1
            yield number, dict(zip(columns, values))


def _read_datasets_dir(spec: str, path: Path, split: str | None) -> Iterator[Record]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, OSError, ValueError) as err:
        raise DataError(
            Problem(
                f"cannot load {path} as a datasets directory: {str(err).splitlines()[0] if str(err) else err}",
                file=spec,
                hint="a directory must be written by Dataset.save_to_disk or DatasetDict.save_to_disk",
            )
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        names = list(loaded)
        chosen = split or (names[0] if len(names) == 1 else "train")
        if chosen not in loaded:
            raise DataError(
                Problem(
                    f"the datasets directory has no split {chosen!r}; its splits: {', '.join(names)}",
                    file=spec,
                    key="split",
                    hint="set the dataset's split: to one of them",
                )
            )
        loaded = loaded[chosen]
    elif split is not None:
        raise DataError(
            Problem(
                f"split {split!r} was asked for, but the directory holds a single dataset",
                file=spec,
                key="split",
                hint="leave split out",
            )
        )
    number = 0
    for batch in loaded.iter(batch_size=ROWS_PER_BATCH):
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns)):
            number += 1
            yield number, dict(zip(columns, values))
