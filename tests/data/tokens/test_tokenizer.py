"""Loading the recipe's tokenizer offline, with eos and pad guaranteed, and fingerprinting it."""

from __future__ import annotations

import json
import shutil

import pytest

from memtrain.data.tokens.tokenizer import ASSETS, load_tokenizer, tokenizer_fingerprint
from memtrain.errors import UserError
from memtrain.recipe.schema import Model

BUILTIN_DIR = ASSETS / "tokenizer" / "shakespeare"


def tokenizer_copy(tmp_path, drop=()):
    """The builtin tokenizer copied to a directory, with the named keys removed from its config."""
    directory = tmp_path / "tok"
    shutil.copytree(BUILTIN_DIR, directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for key in drop:
        config.pop(key)
    config_path.write_text(json.dumps(config))
    return directory


def test_presets_get_the_builtin_tokenizer():
    tokenizer = load_tokenizer(Model(preset="tiny"))
    assert len(tokenizer) == 4096
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|endoftext|>", 0)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|pad|>", 1)
    assert tokenizer.decode(tokenizer("Good night, sweet prince")["input_ids"]) == "Good night, sweet prince"


def test_directory_from_model_path_and_pad_falls_back_to_eos(tmp_path):
    directory = tokenizer_copy(tmp_path, drop=("pad_token",))
    tokenizer = load_tokenizer(Model(path=str(directory)))
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 0


def test_tokenizer_key_wins_over_model_path(tmp_path):
    directory = tokenizer_copy(tmp_path)
    tokenizer = load_tokenizer(Model(path=str(tmp_path / "weights-only"), tokenizer=str(directory)))
    assert tokenizer.eos_token_id == 0


def test_missing_directory_names_the_key(tmp_path):
    with pytest.raises(UserError) as excinfo:
        load_tokenizer(Model(path=str(tmp_path / "absent")))
    [problem] = excinfo.value.problems
    assert problem.key == "model.path" and "does not exist" in problem.message and "builtin:shakespeare" in problem.hint


def test_unknown_builtin_tokenizer():
    with pytest.raises(UserError, match="no builtin tokenizer 'gpt2'"):
        load_tokenizer(Model(tokenizer="builtin:gpt2"))


def test_directory_without_tokenizer_files(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError) as excinfo:
        load_tokenizer(Model(tokenizer=str(tmp_path / "empty")))
    [problem] = excinfo.value.problems
    assert problem.key == "model.tokenizer" and "cannot load a tokenizer" in problem.message
    assert "tokenizer.json" in problem.hint


def test_tokenizer_without_eos_is_refused(tmp_path):
    directory = tokenizer_copy(tmp_path, drop=("eos_token", "bos_token", "pad_token"))
    with pytest.raises(UserError, match="has no eos token"):
        load_tokenizer(Model(tokenizer=str(directory)))


def test_fingerprint_is_stable_and_follows_the_vocabulary(tmp_path):
    first = load_tokenizer(Model(preset="tiny"))
    second = load_tokenizer(Model(tokenizer=str(tokenizer_copy(tmp_path))))
    assert tokenizer_fingerprint(first) == tokenizer_fingerprint(second)
    second.add_tokens(["thou"])
    assert tokenizer_fingerprint(first) != tokenizer_fingerprint(second)
