"""`memtrain report` of a preference run: the rewards plot and the held-out reward accuracy from first to last."""

from __future__ import annotations

import io
import json

import matplotlib.image
from rich.console import Console

from memtrain.commands.report import report_command
from memtrain.monitor.metrics import MetricsLog
from memtrain.monitor.plots import PLOT_FILES, REWARDS_FILE


def _write_run(run_dir, preference: bool = True) -> None:
    """The records a DPO run's loop writes: train steps with rewards, two evaluations of held-out pairs."""
    log = MetricsLog(run_dir / "metrics.jsonl", flush_every=1)
    log.event("run", 0, event="start", recipe="dpo", device="cpu", total_steps=6)
    for step in range(1, 7):
        rewards = {
            "reward_chosen": 0.05 * step,
            "reward_rejected": -0.03 * step,
            "reward_accuracy": min(1.0, 0.4 + 0.1 * step),
            "reward_margin": 0.08 * step,
            "logp_chosen": -20.0 + step,
            "logp_rejected": -21.0 - step,
        }
        log.record(
            "train",
            step,
            loss=0.69 - 0.02 * step,
            tokens=100 * step,
            step_time_s=0.5,
            micro_batch=4,
            **(rewards if preference else {}),
        )
        if step % 3 == 0:
            scores = {"reward_accuracy": 0.3 + 0.1 * step, "reward_margin": 0.05 * step} if preference else {}
            log.event("eval", step, loss=0.7 - 0.01 * step, **(scores or {"perplexity": 2.0}))
    log.event("run", 6, event="end", status="done")
    log.close()


def test_a_preference_run_reports_its_rewards(tmp_path):
    _write_run(tmp_path)
    out = io.StringIO()
    assert report_command(tmp_path, as_json=True, console=Console(file=out, width=200)) == 0
    summary = json.loads(out.getvalue())
    assert abs(summary["first_reward_accuracy"] - 0.6) < 1e-12 and summary["first_reward_accuracy_step"] == 3
    assert abs(summary["final_reward_accuracy"] - 0.9) < 1e-12 and summary["final_reward_accuracy_step"] == 6
    assert abs(summary["final_reward_margin"] - 0.3) < 1e-12
    assert summary["plots"][-1] == str(tmp_path / REWARDS_FILE)
    image = matplotlib.image.imread(tmp_path / REWARDS_FILE)
    assert image.shape[0] > 100 and image.std() > 0.01  # drawn, not blank
    table = io.StringIO()
    report_command(tmp_path, as_json=False, console=Console(file=table, width=200))
    assert "held-out reward accuracy" in table.getvalue()
    assert "0.600 at step 3 → 0.900 at step 6 (margin 0.3000)" in table.getvalue()


def test_an_sft_run_draws_no_rewards_plot(tmp_path):
    _write_run(tmp_path, preference=False)
    out = io.StringIO()
    report_command(tmp_path, as_json=True, console=Console(file=out, width=200))
    summary = json.loads(out.getvalue())
    assert summary["plots"] == [str(tmp_path / name) for name in PLOT_FILES]
    assert summary["final_reward_accuracy"] is None
    assert not (tmp_path / REWARDS_FILE).exists()
