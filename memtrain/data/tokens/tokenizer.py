"""Loading the tokenizer a recipe names, offline, with the special tokens training needs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from memtrain.errors import Problem, UserError
from memtrain.hub import hub_repo, model_dir
from memtrain.recipe.schema import BUILTIN_PREFIX, Model

ASSETS = Path(__file__).resolve().parents[2] / "assets"


def builtin_tokenizer_names() -> list[str]:
    """Names of the bundled tokenizers ('shakespeare')."""
    return sorted(p.name for p in (ASSETS / "tokenizer").iterdir() if p.is_dir())


def load_tokenizer(model: Model) -> PreTrainedTokenizerBase:
    """The tokenizer for `model`: `model.tokenizer` ('builtin:NAME' or a directory), else `model.path`,
    else the builtin Shakespeare BPE. Loads local files only. Guarantees an eos token and a pad token
    (pad = eos when the tokenizer has none). Raises `UserError` when it cannot be loaded.
    """
    directory, key = tokenizer_directory(model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(
            Problem(
                f"cannot load a tokenizer from {directory}: "
                f"{str(err).splitlines()[0] if str(err) else type(err).__name__}",
                key=key,
                hint="the directory needs tokenizer.json (or the tokenizer files of its model) and "
                "tokenizer_config.json; set model.tokenizer to another directory or to builtin:shakespeare",
            )
        ) from None
    if tokenizer.eos_token_id is None:
        raise UserError(
            Problem(
                f"the tokenizer in {directory} has no eos token, which separates documents",
                key=key,
                hint='add "eos_token" to its tokenizer_config.json',
            )
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tokenizer_directory(model: Model) -> tuple[Path, str]:
    """(the directory `load_tokenizer` reads, the recipe key that names it); UserError for an unknown builtin."""
    if model.tokenizer is not None:
        return _resolve(model.tokenizer, "model.tokenizer"), "model.tokenizer"
    if model.path is not None:
        return _resolve(model.path, "model.path", model.revision), "model.path"
    return _resolve(BUILTIN_PREFIX + "shakespeare", "model.tokenizer"), "model.tokenizer"


def has_chat_template(directory: Path) -> bool | None:
    """Whether the tokenizer files in `directory` carry a chat template, read from the files without loading the
    tokenizer (chat_template.jinja / .json, or tokenizer_config.json's chat_template); None when unreadable."""
    if (directory / "chat_template.jinja").is_file() or (directory / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((directory / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return None


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 over everything that decides token ids: the tokenizer's full definition and its special tokens."""
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    else:  # a Python/SentencePiece tokenizer: its vocabulary stands in for the definition
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    specials = {"eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id, "size": len(tokenizer)}
    digest.update(json.dumps(specials, sort_keys=True).encode())
    return digest.hexdigest()


def _resolve(spec: str, key: str, revision: str | None = None) -> Path:
    if hub_repo(spec):  # a model by Hub id: its tokenizer files, from the cache or downloaded
        return model_dir(spec, revision, need="tokenizer", key=key)
    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX) :]
        if name not in builtin_tokenizer_names():
            raise UserError(
                Problem(
                    f"there is no builtin tokenizer {name!r}",
                    key=key,
                    hint="use " + ", ".join(BUILTIN_PREFIX + n for n in builtin_tokenizer_names()) + " or a directory",
                )
            )
        return ASSETS / "tokenizer" / name
    directory = Path(spec).expanduser()
    if not directory.is_dir():
        what = "is a file, not a directory" if directory.exists() else "does not exist"
        raise UserError(
            Problem(
                f"tokenizer directory {directory} {what}",
                key=key,
                hint="point it at a local Hugging Face model or tokenizer directory, or use builtin:shakespeare",
            )
        )
    return directory
