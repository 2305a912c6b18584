"""`memtrain export`: the command around memtrain.model.final_dir (whose merge is proven in
tests/model/test_merge.py)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from memtrain.cli import app


def test_a_directory_that_is_not_a_finished_run_is_a_user_error(tmp_path):
    missing = CliRunner().invoke(app, ["export", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "there is no run directory" in missing.output
    assert "Traceback" not in missing.output
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "recipe.json").write_text(json.dumps({}))
    unfinished = CliRunner().invoke(app, ["export", str(tmp_path / "run"), "--merge"])
    assert unfinished.exit_code == 2 and "final" in unfinished.output, unfinished.output
    assert not (tmp_path / "run" / "merged").exists()


def _full_run(tmp_path):
    """A finished full fine-tune as `memtrain export` sees it: recipe.json and a whole model in final/."""
    from memtrain.recipe.schema import Data, Model, Recipe

    run_dir = tmp_path / "run"
    (run_dir / "final").mkdir(parents=True)
    recipe = Recipe(model=Model(preset="micro"), data=Data(train="builtin:shakespeare"))
    (run_dir / "recipe.json").write_text(recipe.model_dump_json())
    (run_dir / "final" / "config.json").write_text("{}")
    (run_dir / "final" / "model.safetensors").write_bytes(b"weights")
    return run_dir


def test_an_output_that_cannot_be_created_says_why(tmp_path):
    run_dir = _full_run(tmp_path)
    (tmp_path / "chat.yaml").write_text("mine")
    through_file = CliRunner().invoke(app, ["export", str(run_dir), "-o", str(tmp_path / "chat.yaml" / "out")])
    assert through_file.exit_code == 2, through_file.output
    assert "is a file, where a directory is needed" in through_file.output
    assert "already exists" not in through_file.output and "Traceback" not in through_file.output
    proc = CliRunner().invoke(app, ["export", str(run_dir), "-o", "/proc/memtrain-export-test"])
    assert proc.exit_code == 2, proc.output
    assert "cannot create '/proc/memtrain-export-test'" in proc.output and "Traceback" not in proc.output


def test_merge_of_a_full_fine_tune_says_there_was_no_adapter_and_the_model_was_copied(tmp_path):
    run_dir = _full_run(tmp_path)
    result = CliRunner().invoke(app, ["export", str(run_dir), "--merge"])
    assert result.exit_code == 0, result.output
    merged = run_dir / "merged"
    assert (merged / "model.safetensors").read_bytes() == b"weights"
    said = " ".join(result.output.split())  # rich wraps the line, paths too
    assert f"modelin{merged}" in "".join(said.split()) and "no adapter to merge" in said and "copied as it is" in said
    plain = CliRunner().invoke(app, ["export", str(run_dir)])
    assert plain.exit_code == 0 and "no adapter to merge" not in plain.output


def test_an_export_larger_than_the_free_space_is_refused_before_anything_is_written(tmp_path):
    """A sparse file: a final/ that says it holds more than any disk here has free, on no real space."""
    run_dir = _full_run(tmp_path)
    with open(run_dir / "final" / "model-00002.safetensors", "wb") as sparse:
        sparse.truncate(1 << 43)  # 8 TiB apparent (ext4 takes files up to 16 TiB)
    out = tmp_path / "shipped"
    result = CliRunner().invoke(app, ["export", str(run_dir), "-o", str(out)])
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "not enough space for the model" in said and "it takes ~8192.0 GiB" in said, said
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".shipped")]


def test_an_export_that_fails_writing_ends_with_one_line_and_leaves_nothing(tmp_path):
    """A real write failure without root: a file size limit (EFBIG) below the model's size."""
    import resource
    import signal
    import subprocess
    import sys

    run_dir = _full_run(tmp_path)
    (run_dir / "final" / "model.safetensors").write_bytes(b"\0" * (2 << 20))
    out = tmp_path / "shipped"

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))

    done = subprocess.run(
        [sys.executable, "-m", "memtrain", "export", str(run_dir), "-o", str(out)],
        text=True,
        preexec_fn=small_files,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=300,
    )
    said = " ".join(done.stdout.split())
    assert done.returncode == 2 and "Traceback" not in done.stdout, done.stdout[-3000:]
    assert f"cannot create '{out}'" in said and "the partial output was removed" in said, said
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".shipped")]
