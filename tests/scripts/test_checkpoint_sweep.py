"""The GPU checkpoint sweep's bookkeeping, run on the CPU with the tiny preset (2 steps per strategy)."""

from __future__ import annotations

import csv

import pytest

from scripts import checkpoint_sweep as sweep
from tests.model.test_support import one_torch_thread  # noqa: F401


@pytest.mark.slow  # 5-20 s on two cores: plain pytest stays under 2 minutes; scripts/test.sh (CI) runs it
def test_cpu_sweep_writes_one_row_per_strategy_and_appends(tmp_path):
    out = tmp_path / "sweep.csv"
    argv = [
        "--device",
        "cpu",
        "--preset",
        "tiny",
        "--micro-batch",
        "2",
        "--seq-len",
        "32",
        "--steps",
        "2",
        "--strategies",
        "none,every_2,selective,offload",
        "--out",
        str(out),
    ]
    assert sweep.main(argv) == 0
    assert sweep.main([*argv[:-3], "none", "--lora", "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert list(rows[0]) == sweep.COLUMNS
    assert [r["strategy"] for r in rows] == ["none", "every_2", "selective", "offload", "none"]
    assert [r["recipe"] for r in rows] == ["tiny-full-mb2-seq32"] * 4 + ["tiny-lora-mb2-seq32"]
    for row in rows:
        assert float(row["step_time_s"]) > 0
        step_s = float(row["step_time_s"])  # written to 4 decimals: that rounding bounds the agreement
        assert float(row["tokens_per_s"]) == pytest.approx(64 / step_s, rel=1e-3 + 0.5e-4 / step_s)
        assert row["peak_allocated_gib"] == "n/a"
        assert row["command"].startswith("python -m scripts.checkpoint_sweep --device cpu")


def test_unknown_strategy_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        sweep.parse_args(["--preset", "tiny", "--strategies", "every_3", "--out", str(tmp_path / "x.csv")])
    assert "every_3" in capsys.readouterr().err
