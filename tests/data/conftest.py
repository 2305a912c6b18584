"""Fixtures for the data tests: the bundled tokenizers, a private token cache, and record files written on the fly."""

from __future__ import annotations

import json

import pytest

from memtrain.data.tokens.tokenizer import load_tokenizer
from memtrain.recipe.schema import Data, Model


@pytest.fixture(scope="session")
def chat_tokenizer():
    """The Shakespeare BPE with ChatML markers and a chatml chat_template (builtin:shakespeare-chat)."""
    return load_tokenizer(Model(preset="tiny", tokenizer="builtin:shakespeare-chat"))


@pytest.fixture(scope="session")
def text_tokenizer():
    """The plain Shakespeare BPE: no chat markers, no chat_template."""
    return load_tokenizer(Model(preset="tiny", tokenizer="builtin:shakespeare"))


@pytest.fixture
def write_jsonl(tmp_path):
    """write_jsonl(name, records) -> path of a JSONL file with one JSON object (or raw line, for str) per line."""

    def write(name: str, records: list) -> str:
        path = tmp_path / name
        lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
        path.write_text("\n".join(lines) + "\n")
        return str(path)

    return write


@pytest.fixture
def make_data(tmp_path):
    """make_data(train=[...], **keys) -> a Data section whose token cache is private to the test."""

    def make(**keys) -> Data:
        keys.setdefault("cache_dir", str(tmp_path / "cache"))
        return Data(**keys)

    return make
