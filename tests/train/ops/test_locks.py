"""A lock file left by a killed op build is removed; one a live process holds is left alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from torch.utils import cpp_extension

from memtrain.train.ops import locks as op_locks
from memtrain.train.ops.locks import clear_stale_locks, stale_locks


@pytest.fixture
def torch_with_lock_files(monkeypatch):
    """These tests are about PyTorch < 2.14's lock files, whichever PyTorch runs them."""
    monkeypatch.setattr(op_locks, "builds_leave_lock_files", lambda: True)


@pytest.mark.usefixtures("torch_with_lock_files")
def test_a_lock_no_process_holds_is_removed_and_said(tmp_path, capsys):
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "lock").write_bytes(b"")  # as a build killed between O_EXCL create and release
    assert clear_stale_locks(tmp_path) == [tmp_path / "cpu_adam" / "lock"]
    assert not (tmp_path / "cpu_adam" / "lock").exists()
    assert "cpu_adam op was killed" in capsys.readouterr().err


@pytest.mark.usefixtures("torch_with_lock_files")
def test_a_lock_held_open_by_a_live_build_stays(tmp_path):
    lock = tmp_path / "async_io" / "lock"
    lock.parent.mkdir()
    # the holder as torch's FileBaton is: the file created with O_EXCL and kept open until released
    hold = f"import os, time; os.open({str(lock)!r}, os.O_CREAT | os.O_EXCL); print('held', flush=True); time.sleep(60)"
    holder = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert stale_locks(tmp_path, recheck_s=0.1) == []
        assert clear_stale_locks(tmp_path) == [] and lock.exists()
    finally:
        holder.kill()
        holder.wait()
    assert stale_locks(tmp_path, recheck_s=0.1) == [lock]  # its holder gone, the same file is stale


@pytest.mark.usefixtures("torch_with_lock_files")
def test_a_lock_released_during_the_recheck_is_not_reported(tmp_path):
    lock = tmp_path / "pin_memory" / "lock"
    lock.parent.mkdir()
    fd = os.open(lock, os.O_CREAT | os.O_EXCL)
    os.close(fd)  # closed, as a holder does just before it removes the file
    remover = subprocess.Popen([sys.executable, "-c", f"import os, time; time.sleep(0.2); os.remove({str(lock)!r})"])
    assert stale_locks(tmp_path, recheck_s=1.0) == []
    remover.wait()


def test_a_torch_with_advisory_locks_has_nothing_to_clear_and_says_nothing(tmp_path, capsys, monkeypatch):
    """PyTorch >= 2.14 keeps its (released) lock file after every build: it is no sign of a killed one."""
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "lock").write_bytes(b"")
    monkeypatch.delattr(cpp_extension, "FileBaton", raising=False)  # as in 2.14, whose loader imports FileLock
    assert clear_stale_locks(tmp_path) == [] and (tmp_path / "cpu_adam" / "lock").exists()
    assert capsys.readouterr().err == ""


def test_this_torch_is_told_apart_by_its_loader():
    assert op_locks.builds_leave_lock_files() == hasattr(cpp_extension, "FileBaton")
    if hasattr(cpp_extension, "FileLock"):  # 2.14 and later: the advisory lock
        assert not op_locks.builds_leave_lock_files()
