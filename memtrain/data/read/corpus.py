"""Reading training text: .txt, .jsonl (one field), gzip, and the bundled builtin corpora.

A text file is one document; a JSONL file is one document per line (the string in one field).
Every problem with the input is a `DataError` that names the file and, for JSONL, the line.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import zlib
from collections.abc import Iterator
from pathlib import Path

from memtrain.data.read.file_memo import remembered_fingerprint
from memtrain.data.read.problems import FileProblems
from memtrain.errors import DataError, Problem
from memtrain.files import digest_file
from memtrain.recipe.schema import BUILTIN_PREFIX

ASSETS = Path(__file__).resolve().parents[2] / "assets"
FORMATS = ("text", "jsonl")


def json_kind(value: object) -> str:
    """A JSON value's kind as people name it, for messages: 'a whole number', not 'a int'."""
    kinds = (
        (bool, "true/false"),
        (int, "a whole number"),
        (float, "a number"),
        (str, "a string"),
        (list, "a list"),
        (dict, "an object"),
    )
    return (
        "null"
        if value is None
        else next((name for kind, name in kinds if isinstance(value, kind)), f"a {type(value).__name__}")
    )


def builtin_corpus_names() -> list[str]:
    """'shakespeare' (its train split) and 'shakespeare/validation', for every bundled corpus."""
    names = []
    for corpus in sorted((ASSETS / "corpus").iterdir()):
        for split in sorted(corpus.glob("*.txt.gz")):
            stem = split.name[: -len(".txt.gz")]
            names.append(corpus.name if stem == "train" else f"{corpus.name}/{stem}")
    return names


def resolve_path(spec: str) -> Path:
    """The file behind `spec`: 'builtin:NAME[/SPLIT]' maps to the bundled corpus, anything else is a path."""
    if not spec.startswith(BUILTIN_PREFIX):
        return Path(spec).expanduser()
    name = spec[len(BUILTIN_PREFIX) :]
    if name not in builtin_corpus_names():
        raise DataError(
            Problem(
                f"there is no builtin corpus {name!r}",
                file=spec,
                hint="use one of " + ", ".join(BUILTIN_PREFIX + n for n in builtin_corpus_names()) + ", or a file path",
            )
        )
    corpus, _, split = name.partition("/")
    return ASSETS / "corpus" / corpus / f"{split or 'train'}.txt.gz"


def resolve_format(spec: str, fmt: str = "auto") -> str:
    """'text' or 'jsonl': `fmt` itself, or with 'auto' the file extension (.jsonl[.gz] is JSONL, all else text)."""
    if fmt in FORMATS:
        return fmt
    if fmt != "auto":
        raise DataError(
            Problem(f"unknown data format {fmt!r}", key="data.format", file=spec, hint="use auto, text or jsonl")
        )
    name = resolve_path(spec).name.lower()
    if name.endswith(".gz"):
        name = name[: -len(".gz")]
    if name.endswith(RECORD_FILES):
        raise DataError(_record_file_as_text(spec))
    return "jsonl" if name.endswith((".jsonl", ".ndjson")) else "text"


# Files of records that a path in data.train / data.validation would read as plain text, syntax and all
RECORD_FILES = (".json", ".csv", ".tsv", ".parquet", ".arrow")


def _record_file_as_text(spec: str) -> Problem:
    kind = Path(spec.removesuffix(".gz")).suffix.lstrip(".").lower()
    return Problem(
        f"'{spec}' is a .{kind} file of records, which a data path alone would train on as plain text "
        "(its syntax and all)",
        file=spec,
        hint=f"give it as a dataset: [{{path: {spec}, type: instruction}}] (or type chat, completion, text "
        "with field: NAME); .json and .parquet are read as records there"
        + ("; CSV is not read: convert it to JSONL or parquet" if kind in ("csv", "tsv") else "")
        + ", or set data.format: text to train on the file's characters",
    )


def read_documents(spec: str, fmt: str = "auto", field: str = "text") -> Iterator[str]:
    """Yield the documents of `spec` (a .txt/.jsonl path, optionally gzipped, or 'builtin:shakespeare').

    Empty documents are skipped. Raises `DataError` naming file and line for an unreadable file,
    a file with no text, invalid JSON, a missing or non-string field; JSONL problems are collected
    and raised together after the last line (data/read/problems.py).
    """
    path = resolve_path(spec)
    kind = resolve_format(spec, fmt)
    if kind == "text":
        yield from _read_text(spec, path)
    else:
        yield from _read_jsonl(spec, path, field)


def source_fingerprint(spec: str, fmt: str, field: str, memo_root: Path | None = None) -> str:
    """sha256 over the file's bytes, its resolved format and the field: changes when any of them does;
    hashed once per version of the file when `memo_root` (the token cache) is given (file_memo.py)."""
    path = resolve_path(spec)
    suffix = f"\0{resolve_format(spec, fmt)}\0{field}"

    def compute() -> str:
        digest = hashlib.sha256()
        try:
            digest_file(digest, path)
        except OSError as err:
            raise _unreadable(spec, path, err) from None
        digest.update(suffix.encode())
        return digest.hexdigest()

    return remembered_fingerprint([path], f"corpus{suffix}", compute, memo_root)


# ---------------------------------------------------------------- readers


def _open_binary(spec: str, path: Path):
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        if path.is_dir():
            raise IsADirectoryError(21, "is a directory")
        return opener(path, "rb")
    except OSError as err:
        raise _unreadable(spec, path, err) from None


def _unreadable(spec: str, path: Path, err: Exception) -> DataError:
    reason = getattr(err, "strerror", None) or str(err)
    return DataError(
        Problem(
            f"cannot read {path}: {reason}",
            file=spec,
            hint="check the path in the recipe (relative paths start at the working directory)",
        )
    )


def _read_text(spec: str, path: Path) -> Iterator[str]:
    with _open_binary(spec, path) as handle:
        try:
            raw = handle.read()
        except (OSError, EOFError, zlib.error) as err:  # a damaged or truncated .gz
            raise _unreadable(spec, path, err) from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise DataError(
            Problem(f"byte {err.start} is not UTF-8 text", file=spec, line=line, hint="convert the file to UTF-8")
        ) from None
    if not text.strip():
        raise DataError(Problem("the file has no text", file=spec, hint="point data.train at a file with text"))
    yield text


def _read_jsonl(spec: str, path: Path, field: str) -> Iterator[str]:
    problems = FileProblems(spec)
    n_documents = 0
    with _open_binary(spec, path) as handle:
        line_no = 0
        try:
            for line_no, raw in enumerate(handle, start=1):
                text = _parse_line(spec, raw, line_no, field, problems)
                if problems:  # keep scanning without yielding: one check reports every bad line
                    continue
                if text:
                    n_documents += 1
                    yield text
        except (OSError, EOFError, zlib.error) as err:
            raise DataError(
                Problem(
                    f"cannot read past line {line_no}: {err}",
                    file=spec,
                    line=line_no + 1,
                    hint="the file is damaged or truncated; recreate it",
                )
            ) from None
    problems.raise_if_any()
    if n_documents == 0:
        raise DataError(
            Problem(
                f"the file has no documents with text in field {field!r}",
                file=spec,
                hint="check data.field and that the file is not empty",
            )
        )


def _parse_line(spec: str, raw: bytes, line_no: int, field: str, problems: FileProblems) -> str:
    """The document on one JSONL line ('' for a blank line); adds to `problems` when it has none."""
    if line_no == 1 and raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    if not raw.strip():
        return ""
    try:
        record = json.loads(raw)
    except UnicodeDecodeError:
        problems.add(Problem("the line is not UTF-8 text", file=spec, line=line_no, hint="convert the file to UTF-8"))
        return ""
    except json.JSONDecodeError as err:
        problems.add(
            Problem(
                f"invalid JSON: {err.msg} (column {err.colno})",
                file=spec,
                line=line_no,
                hint="each line must be one JSON object",
            )
        )
        return ""
    if not isinstance(record, dict):
        problems.add(
            Problem(
                f"the line holds {json_kind(record)}, not an object",
                file=spec,
                line=line_no,
                hint=f'write each line as {{"{field}": "..."}}',
            )
        )
        return ""
    if field not in record:
        fields = ", ".join(record) or "none"
        problems.add(
            Problem(
                f"line {line_no} has no field {field!r}; fields there: {fields}",
                file=spec,
                line=line_no,
                hint="set data.field to the field that holds the text",
            )
        )
        return ""
    value = record[field]
    if not isinstance(value, str):
        problems.add(
            Problem(
                f"field {field!r} is {json_kind(value)}, not a string",
                file=spec,
                line=line_no,
                hint="the text field must hold a JSON string",
            )
        )
        return ""
    return value
