"""memtrain.files: an output path that cannot be created is a UserError naming what is in the way, not a traceback."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

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


@pytest.mark.parametrize(
    "code, says",
    [
        (errno.EACCES, "no permission"),
        (errno.EROFS, "read-only filesystem"),
        (errno.ENOSPC, "no space left"),
        (errno.ENOENT, "No such file"),
    ],
)
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
        with atomic_path(tmp_path / "f.json"):
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


def test_replacing_a_directory_never_leaves_it_half_deleted(tmp_path, monkeypatch):
    """final/ being a directory tells a rerun that the export is done: a kill at any moment of its replacement
    (after raising train.steps) must leave it the old one or the new one, whole, or absent."""
    target = tmp_path / "final"
    target.mkdir()
    for name in ("config.json", "model.safetensors"):
        (target / name).write_text("old")
    seen = []
    rmtree, replace = shutil.rmtree, os.replace

    def look():
        seen.append({p.name: p.read_text() for p in target.iterdir()} if target.is_dir() else None)

    def removing(path, *args, **kwargs):  # a kill while deleting: the first file is gone, the rest not yet
        first = next((p for p in sorted(Path(path).rglob("*")) if p.is_file()), None)
        if first is not None:
            first.unlink()
            look()
        rmtree(path, *args, **kwargs)

    def renaming(src, dst):
        look()
        replace(src, dst)
        look()

    monkeypatch.setattr(shutil, "rmtree", removing)
    monkeypatch.setattr(os, "replace", renaming)
    with atomic_path(target, directory=True) as tmp:
        for name in ("config.json", "model.safetensors"):
            (tmp / name).write_text("new")
    old, new = ({"config.json": s, "model.safetensors": s} for s in ("old", "new"))
    assert seen and all(state in (old, new, None) for state in seen), seen
    assert seen[-1] == new and os.listdir(tmp_path) == ["final"]


def test_the_leftovers_of_a_killed_atomic_write_are_found_and_nothing_else(tmp_path):
    for name in (
        ".final.0123456789ab.tmp",
        ".final.ba9876543210.old",
        "final",
        ".final.keep",
        ".finalx.0123456789ab.tmp",
        ".merged.0123456789ab.tmp",
    ):
        (tmp_path / name).mkdir()
    (tmp_path / ".final.k2_9xq0z.tmp").write_text("a mkstemp temporary")
    assert [p.name for p in files.leftovers(tmp_path / "final")] == [
        ".final.0123456789ab.tmp",
        ".final.ba9876543210.old",
        ".final.k2_9xq0z.tmp",
    ]
    assert files.leftovers(tmp_path / "missing" / "final") == []
