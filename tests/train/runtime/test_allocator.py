"""Allocator settings: memtrain adds its own (expandable segments, the pinned rounding threshold, parallel pinning)
unless the user chose the key, and a PyTorch that does not know a key is no error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from memtrain.train.runtime.allocator import (
    pinning_threads,
    set_allocator_setting,
    use_expandable_segments,
    use_parallel_pinning,
)


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


@pytest.mark.parametrize(
    "user, asked, on",
    [("expandable_segments:False", True, False), ("max_split_size_mb:128,expandable_segments:True", False, True)],
)
def test_the_users_alloc_conf_wins(settings, monkeypatch, user, asked, on):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", user)
    assert use_expandable_segments(asked) is on
    assert settings == []  # nothing was overridden


def test_a_key_this_pytorch_does_not_know_is_not_in_force(settings):
    assert set_allocator_setting("unknown_key", "1") is False
    assert settings == []


@pytest.mark.parametrize("cpus, threads", [(1, 1), (2, 2), (3, 2), (12, 8), (16, 16), (128, 16)])
def test_pinning_threads_are_a_power_of_two_within_the_usable_cores(cpus, threads):
    assert pinning_threads(cpus) == threads


def test_parallel_pinning_registers_pages_faulted_by_several_threads(settings):
    assert use_parallel_pinning(12, kernel_release="6.8.0-49-generic") is True
    assert settings == ["pinned_use_cuda_host_register:True", "pinned_num_register_threads:8"]


def test_wsl_keeps_pytorchs_pinning(settings):
    assert use_parallel_pinning(12, kernel_release="5.15.167.4-microsoft-standard-WSL2") is False
    assert settings == []
    assert use_parallel_pinning(12, kernel_release="6.8.0-49-generic") is True


def test_the_users_pinning_choice_wins(settings, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "pinned_use_cuda_host_register:False")
    assert use_parallel_pinning(12, kernel_release="6.8.0-49-generic") is False
    assert settings == []


def test_this_pytorch_knows_the_pinning_keys_and_their_values():
    """The real allocator config (in a child, which may keep the settings): a misspelt key or a thread count
    PyTorch refuses would leave pinning serial without a word."""
    code = (
        "import torch; from memtrain.train.runtime.allocator import pinning_threads, use_parallel_pinning; "
        "print(use_parallel_pinning(12, kernel_release='6.8.0-generic')); "
        "[torch._C._accelerator_setAllocatorSettings(f'pinned_num_register_threads:{pinning_threads(n)}') "
        "for n in (1, 3, 12, 64)]; print('accepted')"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.split() == ["True", "accepted"], done.stderr[-2000:]
