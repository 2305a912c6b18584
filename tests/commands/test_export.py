"""`memtrain export`: the command around memtrain.model.export (whose merge is proven in tests/model/test_merge.py)."""
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
