"""A lock file left by a killed op build is removed; one a live process holds is left alone."""
from __future__ import annotations

import os
import subprocess
import sys

from memtrain.train.op_locks import clear_stale_locks, stale_locks


def test_a_lock_no_process_holds_is_removed_and_said(tmp_path, capsys):
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "lock").write_bytes(b"")  # as a build killed between O_EXCL create and release
    assert clear_stale_locks(tmp_path) == [tmp_path / "cpu_adam" / "lock"]
    assert not (tmp_path / "cpu_adam" / "lock").exists()
    assert "cpu_adam op was killed" in capsys.readouterr().err


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


def test_a_lock_released_during_the_recheck_is_not_reported(tmp_path):
    lock = tmp_path / "pin_memory" / "lock"
    lock.parent.mkdir()
    fd = os.open(lock, os.O_CREAT | os.O_EXCL)
    os.close(fd)  # closed, as a holder does just before it removes the file
    remover = subprocess.Popen([sys.executable, "-c", f"import os, time; time.sleep(0.2); os.remove({str(lock)!r})"])
    assert stale_locks(tmp_path, recheck_s=1.0) == []
    remover.wait()
