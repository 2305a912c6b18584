"""Models and datasets by Hugging Face Hub id, read from huggingface_hub's cache, downloaded into it once.

Datasets are always written `hub:org/name` (a dataset's path is too often a relative `dir/file`): `dataset_dir` gives
the repo's snapshot, which memtrain.data.read.records hands to datasets.load_dataset; the commit is its fingerprint.

A recipe's `model.path` names a local directory or a Hub repo. A path that exists wins; an `org/name` that is no
existing path is a Hub id, written `hub:org/name` once the recipe is read (memtrain.recipe.load), so a run's record
says which it was. `hub:org/name` forces the Hub; `./org/name` (or an absolute path) forces a local directory.

Only the files a command needs are fetched: `memtrain plan` and `validate` the config.json, reading data the
tokenizer files, training the weights too (safetensors and their index). huggingface_hub does the work: its cache
(HF_HUB_CACHE, HF_HOME), its token (HF_TOKEN, `hf auth login`), its offline mode (HF_HUB_OFFLINE=1 serves the cache)
and its progress bars. A run pins the commit it downloaded (`pinned_revision`), so its workers, its resume and
`eval` / `export` / `chat` afterwards read exactly those weights.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from huggingface_hub import constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from memtrain.errors import Problem, UserError

HUB_PREFIX = "hub:"
# huggingface_hub's repo id rule, reduced to what tells an id from a relative path: two parts, no dot first
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")

CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json")

# What each need fetches, and the file whose presence in a cached snapshot says it is there already.
NEEDS: dict[str, tuple[tuple[str, ...], Callable[[Path], bool]]] = {
    "config": (CONFIG_FILES, lambda d: (d / "config.json").is_file()),
    "tokenizer": (
        CONFIG_FILES + TOKENIZER_FILES,
        lambda d: (d / "tokenizer_config.json").is_file() or (d / "tokenizer.json").is_file(),
    ),
    "model": (
        CONFIG_FILES + TOKENIZER_FILES + WEIGHT_FILES,
        lambda d: (d / "config.json").is_file() and any(d.glob("*.safetensors")),
    ),
}


def looks_like_repo_id(value: object) -> bool:
    """Whether a recipe value has the form of a Hub id (org/name), whatever exists on disk."""
    return isinstance(value, str) and bool(_REPO_ID.match(value))


def hub_repo(path: str | None) -> str | None:
    """The Hub repo id a model.path names (`hub:org/name`), or None for a local directory."""
    if path and path.startswith(HUB_PREFIX):
        return path[len(HUB_PREFIX) :]
    return None


def offline() -> bool:
    """Whether huggingface_hub is told to stay off the network (HF_HUB_OFFLINE=1)."""
    return bool(constants.HF_HUB_OFFLINE)


def model_dir(path: str, revision: str | None = None, need: str = "model", key: str = "model.path") -> Path:
    """The local directory holding `need` ('config', 'tokenizer' or 'model') of a model.path.

    A local path is returned as it is. A Hub id is read from the cache when the files are there (no network), else
    downloaded into it (the Hub's progress bar), unless offline. UserError naming the id and the way out when the
    repo is missing, gated, has no such revision, or is neither cached nor reachable.
    """
    repo = hub_repo(path)
    if repo is None:
        return Path(path).expanduser()
    patterns, present = NEEDS[need]
    cached = _cached(repo, revision, patterns)
    if cached is not None and present(cached):
        return cached
    if offline():
        raise UserError(_not_cached(repo, revision, need, key))
    return _download(repo, revision, need, key, force=False)


def pinned_revision(path: str, revision: str | None, key: str = "model.path") -> str:
    """The commit a run trains: the revision (default main) as the Hub has it now, its model files downloaded (only
    what is missing; offline: the cache's). Workers, resume, eval, export and chat then read this commit."""
    repo = hub_repo(path)
    assert repo is not None, path
    if offline():
        return model_dir(path, revision, "model", key).name
    return _download(repo, revision, "model", key, force=True).name


def dataset_dir(path: str, key: str = "path") -> Path:
    """The local snapshot of a dataset repo (`hub:org/name`): from the cache when there (no network), else downloaded
    into it, unless offline. Its directory name is the commit (`commit_of`). UserError as `model_dir` says it."""
    repo = hub_repo(path)
    assert repo is not None, path
    try:
        return Path(snapshot_download(repo, repo_type="dataset", local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        if offline():
            raise UserError(_not_cached(repo, None, "dataset", key)) from None
    try:
        return Path(snapshot_download(repo, repo_type="dataset"))
    except GatedRepoError:
        raise UserError(_gated(repo, key)) from None
    except RepositoryNotFoundError:
        raise UserError(_missing(repo, key, "dataset")) from None
    except (LocalEntryNotFoundError, HfHubHTTPError) as error:
        raise UserError(_not_cached(repo, None, "dataset", key, str(error).splitlines()[0])) from None


def commit_of(directory: Path) -> str | None:
    """The commit of a snapshot directory of the cache (snapshots/<commit>), or None for another directory."""
    return directory.name if directory.parent.name == "snapshots" else None


def _cached(repo: str, revision: str | None, patterns: tuple[str, ...]) -> Path | None:
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=list(patterns), local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None


def _download(repo: str, revision: str | None, need: str, key: str, force: bool) -> Path:
    """Fetch the files of `need` (config.json alone by hf_hub_download; the rest by snapshot_download)."""
    patterns, present = NEEDS[need]
    try:
        if need == "config" and not force:
            directory = Path(hf_hub_download(repo, "config.json", revision=revision)).parent
        else:
            directory = Path(snapshot_download(repo, revision=revision, allow_patterns=list(patterns)))
    except GatedRepoError:
        raise UserError(_gated(repo, key)) from None
    except RepositoryNotFoundError:
        raise UserError(_missing(repo, key)) from None
    except RevisionNotFoundError:
        raise UserError(
            Problem(
                f"the Hub repo '{repo}' has no revision '{revision}'",
                key="model.revision",
                hint="give a branch, tag or commit the repo has (its 'Files and versions' page lists them)",
            )
        ) from None
    except RemoteEntryNotFoundError:
        raise UserError(_not_a_model(repo, key)) from None
    # no network, or the Hub failed (before EntryNotFoundError: the cache's LocalEntryNotFoundError is one too)
    except (LocalEntryNotFoundError, HfHubHTTPError) as error:
        why = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UserError(_not_cached(repo, revision, need, key, why)) from None
    except EntryNotFoundError:
        raise UserError(_not_a_model(repo, key)) from None
    if not present(directory):
        missing = {"config": "config.json", "tokenizer": "tokenizer files", "model": "safetensors weights"}[need]
        raise UserError(
            Problem(
                f"the Hub repo '{repo}' has no {missing} (memtrain reads config.json, tokenizer.json or "
                "tokenizer_config.json, and *.safetensors)",
                key=key,
                hint="give a repo (or revision) of a transformers model with safetensors weights, or convert it and "
                "give the local directory",
            )
        )
    return directory


def _not_a_model(repo: str, key: str) -> Problem:
    return Problem(
        f"the Hub repo '{repo}' has no config.json: it is not a transformers model",
        key=key,
        hint="give the id of a transformers causal language model, or a local model directory",
    )


def _gated(repo: str, key: str) -> Problem:
    return Problem(
        f"the Hub repo '{repo}' is gated: your account has not been granted access, or you are not logged in",
        key=key,
        hint=f"accept its terms on https://huggingface.co/{repo}, then log in (`hf auth login`) or set HF_TOKEN",
    )


def _missing(repo: str, key: str, kind: str = "model") -> Problem:
    return Problem(
        f"'{repo}' is neither a local directory nor a Hub {kind} repo you can read (the Hub answers: no such repo, "
        "or it is private)",
        key=key,
        hint="check the id; for a private repo log in (`hf auth login`) or set HF_TOKEN; for a local directory give a "
        f"path that exists (./{repo} or an absolute path)",
    )


def _not_cached(repo: str, revision: str | None, need: str, key: str, why: str = "") -> Problem:
    files = {"config": "config.json", "tokenizer": "tokenizer files", "model": "weights", "dataset": "files"}[need]
    kind = "dataset" if need == "dataset" else "model"
    at = f" at revision '{revision}'" if revision else ""
    reason = "HF_HUB_OFFLINE is set" if offline() else f"the Hub cannot be reached{f' ({why})' if why else ''}"
    return Problem(
        f"the {files} of Hub {kind} '{repo}'{at} are not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
        f"{reason}",
        key=key,
        hint="run once with network to fill the cache (unset HF_HUB_OFFLINE; gated or private repos need "
        "`hf auth login` or HF_TOKEN), point HF_HUB_CACHE / HF_HOME at a cache that holds it, or give a local "
        f"{'file or directory' if kind == 'dataset' else 'model directory'}",
    )
