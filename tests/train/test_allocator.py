"""Allocator settings: memtrain adds its own (expandable segments, the pinned rounding threshold)
unless the user chose the key, and a PyTorch that does not know a key is no error."""
from __future__ import annotations

import pytest
import torch

from memtrain.train.allocator import set_allocator_setting, use_expandable_segments


@pytest.fixture
def settings(monkeypatch):
    """Record what memtrain hands PyTorch instead of changing this process's allocator."""
    applied: list[str] = []

    def setter(text: str) -> None:
        if text.startswith("unknown_key"):
            raise ValueError("Unrecognized key 'unknown_key' in Accelerator allocator config.")
        applied.append(text)

    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", setter, raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "", raising=False)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    return applied


def test_expandable_segments_are_set_when_the_user_said_nothing(settings):
    assert use_expandable_segments(True) is True
    assert settings == ["expandable_segments:True"]
    assert use_expandable_segments(False) is False
    assert settings[-1] == "expandable_segments:False"


@pytest.mark.parametrize("user, asked, on", [("expandable_segments:False", True, False),
                                             ("max_split_size_mb:128,expandable_segments:True", False, True)])
def test_the_users_alloc_conf_wins(settings, monkeypatch, user, asked, on):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", user)
    assert use_expandable_segments(asked) is on
    assert settings == []  # nothing was overridden


def test_a_key_this_pytorch_does_not_know_is_not_in_force(settings):
    assert set_allocator_setting("unknown_key", "1") is False
    assert settings == []
