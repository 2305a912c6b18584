"""Command-line options the CLI refuses itself, with exit 2 and no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from memtrain.cli import app

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"


@pytest.mark.parametrize("steps", ["0", "-3"])
def test_max_steps_below_one_is_refused_before_the_run_starts(steps, monkeypatch):
    import memtrain.cli

    monkeypatch.setattr(memtrain.cli, "run_command", lambda *a, **k: pytest.fail("the run started"))
    result = CliRunner().invoke(app, ["run", str(QUICKSTART), "--max-steps", steps])
    assert result.exit_code == 2, result.output
    assert "--max-steps" in result.output and "Traceback" not in result.output
