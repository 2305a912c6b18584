"""memtrain.files: an output path that cannot be created is a UserError naming what is in the way, not a traceback."""
from __future__ import annotations

import errno
import os
import tempfile

import pytest

from memtrain import files
from memtrain.errors import UserError
from memtrain.files import atomic_path, directory_atomically, write_atomically


def test_a_file_where_a_directory_is_needed_is_named(tmp_path):
    (tmp_path / "chat.yaml").write_text("mine")
    for target in (tmp_path / "chat.yaml" / "ds.json", tmp_path / "chat.yaml" / "a" / "b.json"):
        with pytest.raises(UserError) as caught:
            write_atomically(target, "{}")
        problem = caught.value.problems[0]
        assert f"'{tmp_path / 'chat.yaml'}' is a file, where a directory is needed" in problem.message
        assert str(target) in problem.message and "move" in problem.hint
    with pytest.raises(UserError, match="is a file, where a directory is needed"):
        with directory_atomically(tmp_path / "chat.yaml" / "out"):
            pass
    assert (tmp_path / "chat.yaml").read_text() == "mine" and sorted(os.listdir(tmp_path)) == ["chat.yaml"]


@pytest.mark.parametrize("code, says", [(errno.EACCES, "no permission"), (errno.EROFS, "read-only filesystem"),
                                        (errno.ENOSPC, "no space left"), (errno.ENOENT, "No such file")])
def test_a_temporary_that_cannot_be_made_says_why_and_leaves_no_folders(tmp_path, monkeypatch, code, says):
    def refuse(*args, **kwargs):
        raise (PermissionError if code == errno.EACCES else OSError)(code, os.strerror(code))

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    monkeypatch.setattr(files, "_new_directory", refuse)
    for directory in (False, True):
        with pytest.raises(UserError, match=says) as caught:
            with atomic_path(tmp_path / "new" / "deeper" / "out", directory=directory):
                pass
        assert str(tmp_path / "new" / "deeper" / "out") in caught.value.problems[0].message
        assert caught.value.problems[0].hint
    assert os.listdir(tmp_path) == []  # the folders made for it were removed again


def test_errors_while_writing_are_not_rewritten(tmp_path):
    with pytest.raises(OSError, match="disk full"):
        with atomic_path(tmp_path / "f.json") as tmp:
            raise OSError("disk full")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_directories_get_the_usual_permissions_as_os_makedirs_gives(tmp_path, umask):
    old = os.umask(umask)
    try:
        with directory_atomically(tmp_path / "merged") as tmp:
            (tmp / "config.json").write_text("{}")
        os.makedirs(tmp_path / "reference")
    finally:
        os.umask(old)
    mode = (tmp_path / "merged").stat().st_mode & 0o777
    assert mode == 0o777 & ~umask == (tmp_path / "reference").stat().st_mode & 0o777
