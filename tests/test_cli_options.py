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


def test_flags_are_shown_without_a_value_in_every_commands_help():
    """--json, --fit, --help take no value; the help once wrote `--json <bool>` beside them."""
    commands = [c.name or c.callback.__name__ for c in app.registered_commands]
    assert {"plan", "run", "validate", "eval", "preview"} <= set(commands)
    for name in commands:
        shown = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "200"})
        assert shown.exit_code == 0, shown.output
        assert "<bool>" not in shown.output, name
        assert "--help" in shown.output
    plan = CliRunner().invoke(app, ["plan", "--help"], env={"COLUMNS": "200"}).output
    assert "<str>" in plan  # an option that takes a value still says which
