"""Runs that cannot be mixed, lost or silently wrong: end to end on DeepSpeed's CPU accelerator."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from memtrain.cli import app
from memtrain.commands.run import run_command
from memtrain.train.optim.schedule import lr_multiplier
from memtrain.train.resolve import RUN_FILE, RunOptions
from memtrain.train.state.checkpoint import checkpoint_problem, complete_checkpoints
from memtrain.train.state.manifest import MANIFEST_FILE
from memtrain.train.state.resume import UNCOMPARED_DATA_NOTE
from tests.conftest import read_records
from tests.train.state.test_resume import conversations
from tests.train.test_run import run_dir_of

pytestmark = pytest.mark.slow


def run(path: Path, *overrides: str, **options) -> tuple[int, str]:
    """`memtrain run` in this process: (exit code, what it printed)."""
    out = io.StringIO()
    code = run_command(path, list(overrides), RunOptions(**options), console=Console(file=out, width=300))
    return code, out.getvalue()


def cli(*args: str):
    return CliRunner().invoke(app, ["run", *map(str, args)])


def train_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_records(run_dir, "train")]


def test_no_resume_into_a_used_directory_is_refused_and_overwrite_starts_over(write_recipe):
    recipe = write_recipe("owned", {"train": {"steps": 6, "save_every": 3, "eval_every": 100}})
    assert run(recipe)[0] == 0
    run_dir = run_dir_of(recipe)
    before = sorted(p.name for p in complete_checkpoints(run_dir))
    refused = cli(recipe, "--no-resume", "train.steps=4")
    assert refused.exit_code == 2, refused.output
    assert "train.output_dir" in refused.output and "--overwrite" in refused.output
    assert "Traceback" not in refused.output
    assert sorted(p.name for p in complete_checkpoints(run_dir)) == before  # the old run is untouched

    assert cli(recipe, "--no-resume", "--overwrite", "train.steps=4").exit_code == 0
    [old] = run_dir.parent.glob("owned.previous-*")
    assert train_steps(old) == [1, 2, 3, 4, 5, 6]  # moved aside whole
    assert train_steps(run_dir) == [1, 2, 3, 4]  # the new run's metrics hold the new run only
    assert [r["event"] for r in read_records(run_dir, "run")] == ["start", "end"]
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step-000003", "step-000004"]


def test_a_resumed_run_drops_the_records_of_the_steps_it_redoes(write_recipe):
    recipe = write_recipe("redo", {"train": {"steps": 10, "save_every": 5, "eval_every": 100}})
    assert run(recipe, max_steps=7)[0] == 0
    run_dir = run_dir_of(recipe)
    shutil.rmtree(run_dir / "checkpoints" / "step-000007")  # as if killed after step 7, before its save
    code, said = run(recipe)
    assert code == 0
    assert "resuming from step 5 (checkpoint" in said
    assert train_steps(run_dir) == list(range(1, 11))  # steps 6 and 7 once: the redone records replaced

    from memtrain.commands.report import report_command

    out = io.StringIO()
    report_command(run_dir, as_json=True, console=Console(file=out))
    assert '"steps": 10' in out.getvalue()


def test_resume_refuses_changes_that_break_exactness_and_lists_them(write_recipe):
    recipe = write_recipe("strict", {"train": {"steps": 12, "save_every": 6, "eval_every": 100}})
    assert run(recipe, max_steps=6)[0] == 0
    refused = cli(recipe, "data.seq_len=64", "batch.global_batch=16", "train.seed=8", "model.lora.r=4")
    assert refused.exit_code == 2, refused.output
    for change in (
        "data.seq_len",
        "32 → 64",
        "batch.global_batch",
        "8 → 16",
        "train.seed",
        'model.lora (unset) → {"r": 4, ',
    ):  # a section that was not set: one change
        assert change in refused.output, change
    assert "train.output_dir" in refused.output and "--overwrite" in refused.output
    assert "Traceback" not in refused.output
    assert train_steps(run_dir_of(recipe)) == list(range(1, 7))  # nothing ran


def test_resume_applies_a_new_learning_rate_and_says_so(write_recipe):
    recipe = write_recipe("newlr", {"train": {"steps": 12, "save_every": 6, "eval_every": 100}})
    assert run(recipe, max_steps=6)[0] == 0
    code, said = run(recipe, "optimizer.lr=1e-3", "train.eval_every=3")
    assert code == 0, said
    assert "resuming from step 6" in said and "optimizer.lr 0.003 → 0.001" in said
    run_dir = run_dir_of(recipe)
    from memtrain.recipe.schema import Schedule

    lrs = {r["step"]: r["lr"] for r in read_records(run_dir, "train")}
    schedule = Schedule(warmup_steps=2, decay="cosine")
    # the lr logged at step 7 is the one the scheduler set for the next update, as in a straight run
    assert lrs[7] == pytest.approx(1e-3 * lr_multiplier(7, schedule, 12), rel=1e-6)
    assert lrs[6] == pytest.approx(3e-3 * lr_multiplier(6, schedule, 12), rel=1e-6)
    import json

    assert json.loads((run_dir / "recipe.json").read_text())["optimizer"]["lr"] == 1e-3
    assert [e["step"] for e in read_records(run_dir, "eval")] == [6, 9, 12]  # the new cadence after step 6


def test_a_checkpoint_past_the_recipes_steps_is_refused(write_recipe):
    recipe = write_recipe("past", {"train": {"steps": 8, "save_every": 4, "eval_every": 100}})
    assert run(recipe)[0] == 0
    refused = cli(recipe, "train.steps=4")
    assert refused.exit_code == 2 and "past this recipe's 4 steps" in refused.output, refused.output


def test_resume_refuses_data_whose_contents_changed_and_continues_once_it_is_put_back(write_recipe, tmp_path):
    """The recipe names the same file before and after; only what is in it changed."""
    data = tmp_path / "qa.jsonl"
    data.write_text(conversations(40))
    recipe = write_recipe(
        "data",
        {
            "data": {
                "train": [{"path": str(data), "type": "chat"}],
                "validation": None,
                "template": "chatml",
                "add_special_tokens": True,
                "packing": False,
                "seq_len": 64,
                "cache_dir": str(tmp_path / "tokens"),
            },
            "batch": {"global_batch": 4, "micro_batch": 4},
            "train": {"steps": 6, "save_every": 2, "eval_every": 100, "eval_generate": 2},
        },
    )
    assert run(recipe, max_steps=2)[0] == 0
    run_dir = run_dir_of(recipe)
    entries = sorted((tmp_path / "tokens").glob("*.tokens.npy"))

    data.write_text(conversations(40, answer_of_first="3"))  # one record's answer edited, as many records
    refused = cli(recipe)
    assert refused.exit_code == 2, refused.output
    output = " ".join(refused.output.split())  # as one line, however the console wrapped it
    assert f"data.train: changed since the checkpoint: {data} no longer holds the bytes the checkpoint" in output
    assert "put back the data files" in output and "--no-resume --overwrite" in output
    assert "Traceback" not in output
    assert train_steps(run_dir) == [1, 2]  # nothing ran
    assert sorted((tmp_path / "tokens").glob("*.tokens.npy")) == entries  # refused before tokenising it again

    data.write_text(conversations(40))  # put back: resumes, and a new eval_generate is applied (finding 4)
    code, said = run(recipe, "train.eval_generate=0", max_steps=2)  # two more steps: to step 4
    assert code == 0, said
    assert "resuming from step 2" in said and "train.eval_generate 2 → 0" in said
    assert "could not be compared" not in said

    recorded = json.loads((run_dir / RUN_FILE).read_text())
    del recorded["data_fingerprint"]  # run.json as an older memtrain wrote it
    (run_dir / RUN_FILE).write_text(json.dumps(recorded))
    code, said = run(recipe)
    assert code == 0, said
    assert "resuming from step 4" in said and UNCOMPARED_DATA_NOTE in said
    assert train_steps(run_dir) == list(range(1, 7))


def test_nan_steps_skip_the_update_and_k_in_a_row_stop_without_saving_the_bad_state(write_recipe, monkeypatch):
    recipe = write_recipe("nan", {"train": {"steps": 10, "save_every": 2, "eval_every": 100, "max_bad_steps": 3}})
    monkeypatch.setenv("MEMTRAIN_INJECT_NAN", "3,4,5")  # the loop's steps 3-5: steps 4, 5 and 6 of the run
    result = cli(recipe)
    assert result.exit_code == 2, result.output
    assert "from step 4" in result.output and "optimizer.lr" in result.output and "Traceback" not in result.output
    run_dir = run_dir_of(recipe)
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step-000002"]  # step 4 and 6 were bad: not saved
    assert [(e["step"], e["in_a_row"]) for e in read_records(run_dir, "bad_step")] == [(4, 1), (5, 2), (6, 3)]
    ends = [r for r in read_records(run_dir, "run") if r.get("event") == "end"]
    assert ends[-1]["status"] == "diverged" and ends[-1]["step"] == 6


def test_one_nan_step_is_skipped_and_the_run_goes_on_finite(write_recipe, monkeypatch):
    extra = {"train": {"steps": 6, "save_every": 2, "eval_every": 6}}
    clean = write_recipe("clean", extra)
    assert run(clean)[0] == 0
    monkeypatch.setenv("MEMTRAIN_INJECT_NAN", "2")
    faulty = write_recipe("one-nan", extra)
    code, said = run(faulty)
    assert code == 0, said
    run_dir = run_dir_of(faulty)
    assert [e["step"] for e in read_records(run_dir, "bad_step")] == [3]
    losses = {r["step"]: r["loss"] for r in read_records(run_dir, "train")}
    clean_losses = {r["step"]: r["loss"] for r in read_records(run_dir_of(clean), "train")}
    assert (
        losses[3] is None
        and losses[1] == pytest.approx(clean_losses[1])
        and losses[2] == pytest.approx(clean_losses[2])
    )
    assert all(losses[s] is not None for s in (4, 5, 6))  # the skipped update left the weights finite
    assert read_records(run_dir, "eval")[-1]["loss"] is not None
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step-000004", "step-000006"]


def start_two_process_run(write_recipe, name: str):
    """A 2-process CPU run of `memtrain run` in a subprocess, returned once it has logged a training step."""
    import subprocess
    import sys
    import time

    from tests.train.test_run import clean_env

    recipe = write_recipe(
        name,
        {
            "hardware": {"gpus": 2},
            "batch": {"global_batch": 8, "micro_batch": 2},
            "train": {"steps": 2000, "save_every": 1000, "eval_every": 1000, "log_every": 1},
        },
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "memtrain", "run", str(recipe)],
        env=clean_env(OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = run_dir_of(recipe) / "metrics.jsonl"
    deadline = time.time() + 400
    while time.time() < deadline and not (metrics.exists() and '"train"' in metrics.read_text()):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.5)
    return recipe, proc


def family(pid: int) -> list:
    import psutil

    parent = psutil.Process(pid)
    return [parent, *parent.children(recursive=True)]


def wait_gone(processes: list, timeout_s: float) -> list:
    import psutil

    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def wait_idle(processes: list, quiet_s: float, timeout_s: float) -> bool:
    """Whether the processes came to use under 5 % of a core together for `quiet_s` in a row, within `timeout_s`:
    every one of them waiting (a rank in a collective, another asleep), none computing."""
    import time

    import psutil

    def cpu_s() -> float:
        total = 0.0
        for process in processes:
            try:
                times = process.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system
        return total

    deadline = time.monotonic() + timeout_s
    since, used = time.monotonic(), cpu_s()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now, total = time.monotonic(), cpu_s()
        if total - used > 0.05 * (now - since):  # still computing: the quiet spell starts again
            since, used = now, total
        elif now - since >= quiet_s:
            return True
    return False


def test_sigterm_to_the_launcher_of_two_processes_saves_and_leaves_no_process(write_recipe):
    import signal

    recipe, proc = start_two_process_run(write_recipe, "term2")
    processes = family(proc.pid)
    assert len(processes) >= 4, processes  # launcher, torchrun, two workers
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 143, output[-3000:]
    assert not wait_gone(processes, 30), output[-3000:]
    run_dir = run_dir_of(recipe)
    ends = [r for r in read_records(run_dir, "run") if r.get("event") == "end"]
    assert ends[-1]["status"] == "interrupted"
    [saved] = complete_checkpoints(run_dir)
    assert int(saved.name.split("-")[1]) == ends[-1]["step"]  # both ranks saved the same step
    assert (saved / "rng-rank1.pt").is_file()
    manifest = json.loads((saved / MANIFEST_FILE).read_text())["files"]  # rank 0's manifest lists rank 1's files
    assert {"rng-rank0.pt", "rng-rank1.pt"} <= set(manifest) and checkpoint_problem(saved) is None
    assert output.count("interrupted at step") == 1  # one line from rank 0, none from rank 1
    assert "Traceback" not in output


def test_a_stop_while_one_rank_trains_and_the_other_still_starts_ends_with_a_line_not_a_traceback(write_recipe):
    """The signal reaches the ranks in different phases: rank 1 leaves its start-up at once, and rank 0's first
    step, waiting in a collective for rank 1, breaks. Nothing was saved, and the run says so once."""
    import signal
    import subprocess
    import sys
    import time

    from tests.train.test_run import clean_env

    recipe = write_recipe("late-rank", {"hardware": {"gpus": 2}, "batch": {"global_batch": 8, "micro_batch": 2}})
    env = clean_env(OMP_NUM_THREADS="1", MEMTRAIN_INJECT_SLOW_START="600", MEMTRAIN_INJECT_RANK="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "memtrain", "run", str(recipe)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = run_dir_of(recipe) / "metrics.jsonl"
    deadline = time.time() + 400
    while time.time() < deadline and not (metrics.exists() and '"start"' in metrics.read_text()):  # rank 0's loop
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    processes = family(proc.pid)
    assert wait_idle(processes, quiet_s=1.0, timeout_s=120), "rank 0 never came to wait for rank 1"
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 143, output[-3000:]
    assert "Traceback" not in output and "RuntimeError" not in output, output[-3000:]
    assert output.count("stopped by SIGTERM before the run could save") == 1, output[-3000:]
    assert not complete_checkpoints(run_dir_of(recipe))
    assert not wait_gone(processes, 30)


def test_no_worker_outlives_a_launcher_killed_with_sigkill(write_recipe):
    import signal

    _, proc = start_two_process_run(write_recipe, "kill2")
    processes = family(proc.pid)
    assert len(processes) >= 4, processes
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert not wait_gone(processes[1:], 120)  # torchrun and both workers are gone too


def test_a_signal_during_start_up_ends_with_a_line_and_the_conventional_code(write_recipe, monkeypatch):
    import signal

    from memtrain.commands import run as run_module
    from memtrain.train.runtime.signals import Stopped

    recipe = write_recipe("startup")

    def stopped(*args, **kwargs):
        raise Stopped(signal.SIGTERM)

    monkeypatch.setattr(run_module, "prepare", stopped)
    code, said = run(recipe)
    assert code == 143 and "stopped by SIGTERM" in said, said


def test_sigterm_while_the_engine_is_built_exits_143_without_a_traceback(write_recipe):
    import signal
    import subprocess
    import sys
    import time

    from tests.train.test_run import clean_env

    recipe = write_recipe("startup-term", {"train": {"steps": 400}})
    proc = subprocess.Popen(
        [sys.executable, "-m", "memtrain", "run", str(recipe)],
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 300
    while time.time() < deadline and not run_dir_of(recipe).exists():  # setup has begun
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 143, output[-3000:]
    assert "Traceback" not in output and ("stopped by SIGTERM" in output or "interrupted at step" in output), output


def test_a_full_disk_removes_the_partial_save_flushes_the_metrics_and_says_so(write_recipe, monkeypatch):
    recipe = write_recipe("full", {"train": {"steps": 8, "save_every": 2, "eval_every": 100, "log_every": 100}})
    monkeypatch.setenv("MEMTRAIN_INJECT_ENOSPC", "4")
    result = cli(recipe)
    assert result.exit_code == 2, result.output
    assert "no space left on" in result.output and "needs ~" in result.output and "Traceback" not in result.output
    run_dir = run_dir_of(recipe)
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-000002"]  # no partial .tmp- left
    assert train_steps(run_dir) == [1, 2, 3, 4]  # buffered records (log_every 100) were flushed
    assert [r["status"] for r in read_records(run_dir, "run") if r.get("event") == "end"] == ["disk_full"]


def test_low_free_space_is_warned_about_before_a_save(write_recipe, monkeypatch):
    from memtrain.train.state import storage

    monkeypatch.setattr(storage, "free_bytes", lambda path: 1_000_000)  # 1 MB free: less than one checkpoint
    recipe = write_recipe("lowdisk", {"train": {"steps": 2, "save_every": 2, "eval_every": 100}})
    assert run(recipe)[0] == 0
    [event] = read_records(run_dir_of(recipe), "disk")
    assert event["free_bytes"] == 1_000_000 and event["needed_bytes"] > 1_000_000
    assert "the next save will not fit" in event["message"]


def test_an_oom_in_evaluation_shrinks_the_eval_micro_batch_instead_of_ending_the_run(write_recipe, monkeypatch):
    extra = {"train": {"steps": 4, "eval_every": 4, "save_every": 100}}
    clean = write_recipe("eval-clean", extra)
    assert run(clean, save=False)[0] == 0
    monkeypatch.setenv("MEMTRAIN_INJECT_OOM_EVAL", "4:0:mb>=4,4:1:mb>=2")  # twice: 4 -> 2 -> 1
    faulty = write_recipe("eval-oom", extra)
    code, said = run(faulty, save=False)
    assert code == 0, said
    ooms = read_records(run_dir_of(faulty), "oom")
    assert [(o["step"], o["micro_batch"], o["phase"]) for o in ooms] == [(4, 4, "eval"), (4, 2, "eval")]
    [a], [b] = read_records(run_dir_of(clean), "eval"), read_records(run_dir_of(faulty), "eval")
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)  # the same samples, each counted once


def test_a_loss_that_blows_up_from_the_first_step_is_reported_as_diverged(write_recipe):
    """With lr 0.9 the loss is far above step 1's from step 2 on; the grace steps hid it."""
    recipe = write_recipe(
        "blowup",
        {
            "optimizer": {"lr": 0.9},
            "schedule": {"warmup_steps": 0},
            "train": {"steps": 10, "save_every": 100, "eval_every": 100},
        },
    )
    code, said = run(recipe, save=False)
    assert code == 0, said
    run_dir = run_dir_of(recipe)
    losses = {r["step"]: r["loss"] for r in read_records(run_dir, "train")}
    [event] = read_records(run_dir, "divergence")  # once, however long the loss stays high
    assert event["step"] == 6 and event["best_loss"] == pytest.approx(losses[1])
    assert "far above its best" in said.splitlines()[-1] and "optimizer.lr" in said.splitlines()[-1]
    assert "✓" not in said.splitlines()[-1]


def test_ctrl_c_during_the_final_export_lets_it_finish_and_a_second_one_aborts(write_recipe, monkeypatch):
    """The end of the run is under the loop's handlers. A real signal reaches this process at the start of the real
    export. SIGTERM there said "run the same command again to resume" with exit 143 though final/ was complete: a
    run whose export finished is done, and says the stop came during it."""
    import os
    import signal

    from memtrain.train import loop

    export = loop.export_model
    presses = []

    def press_then_export(*args, **kwargs):
        for signum in presses:
            os.kill(os.getpid(), signum)
        return export(*args, **kwargs)

    monkeypatch.setattr(loop, "export_model", press_then_export)
    recipe = write_recipe("ctrlc-export", {"train": {"steps": 4, "save_every": 100, "eval_every": 100}})
    presses[:] = [signal.SIGTERM]
    code, said = run(recipe)
    assert code == 0, said
    assert "trained 4 steps" in said and "stopped by SIGTERM during the export, which finished" in said, said
    assert "run the same command" not in said
    run_dir = run_dir_of(recipe)
    assert (run_dir / "final" / "adapter_config.json").is_file() or any((run_dir / "final").iterdir())
    [end] = [r for r in read_records(run_dir, "run") if r.get("event") == "end"]
    assert end["status"] == "done"
    code, said = run(recipe)
    assert code == 0 and "already trained" in said, said

    twice = write_recipe("ctrlc-export-twice", {"train": {"steps": 4, "save_every": 100, "eval_every": 100}})
    presses[:] = [signal.SIGINT, signal.SIGINT]
    code, said = run(twice)
    assert code == 130 and "stopped by Ctrl-C before the run could save" in said, said
    assert not (run_dir_of(twice) / "final").exists()
    assert [p.name for p in complete_checkpoints(run_dir_of(twice))] == ["step-000004"]  # the last step's save stands


def test_a_save_that_cannot_write_says_where_and_why_and_which_checkpoint_is_kept(write_recipe, monkeypatch):
    """A run directory that turns read-only (not a traceback and exit 1): one line, exit 2."""
    recipe = write_recipe("readonly", {"train": {"steps": 8, "save_every": 2, "eval_every": 100, "log_every": 100}})
    monkeypatch.setenv("MEMTRAIN_INJECT_EROFS", "4")
    result = cli(recipe)
    run_dir = run_dir_of(recipe)
    said = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert f"'{run_dir / 'checkpoints'}' is on a read-only filesystem" in said, said
    assert "the last complete checkpoint, of step 2 (step-000002), kept" in said
    assert "run the same command to resume" in said
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-000002"]  # no partial .tmp- left
    assert [r["status"] for r in read_records(run_dir, "run") if r.get("event") == "end"] == ["unwritable"]


def test_a_full_disk_leaves_one_checkpoint_less_to_make_room_and_says_what_frees_it(write_recipe, monkeypatch):
    """Pruning came after the new checkpoint, so a save needed room for keep_last + 1 and 'lower train.keep_last'
    freed nothing before the save that failed. Now a save prunes to keep_last - 1 (at least 1) first."""
    recipe = write_recipe("full-keep", {"train": {"steps": 8, "save_every": 2, "eval_every": 100}})  # keep_last 2
    monkeypatch.setenv("MEMTRAIN_INJECT_ENOSPC", "6")
    result = cli(recipe)
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "no space left on" in said and "Traceback" not in said, result.output
    run_dir = run_dir_of(recipe)
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step-000004"]  # step 2 went before the save
    assert "the last complete checkpoint, of step 4 (step-000004), kept" in said
    assert "lower train.keep_last" not in said and "make room on that disk" in said  # keep_last 1 would free nothing
    monkeypatch.delenv("MEMTRAIN_INJECT_ENOSPC")
    code, out = run(recipe)
    assert code == 0 and "resuming from step 4" in " ".join(out.split()), out


def test_an_export_that_cannot_write_ends_with_a_line_and_the_same_command_exports_again(write_recipe):
    """A full disk during the export was safetensors' SafetensorError ('... (os error 28)') in a traceback, exit 1.
    A real write error without root: a file size limit (EFBIG) the checkpoint is already past, the export's
    model.safetensors not."""
    import resource
    import signal
    import subprocess
    import sys

    from tests.train.test_run import clean_env

    recipe = write_recipe("export-full", {"train": {"steps": 4, "save_every": 4, "eval_every": 100}})
    assert run(recipe)[0] == 0
    run_dir = run_dir_of(recipe)
    shutil.rmtree(run_dir / "final")  # trained and saved; the export is all a rerun does

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))

    done = subprocess.run(
        [sys.executable, "-m", "memtrain", "run", str(recipe)],
        env=clean_env(),
        text=True,
        preexec_fn=small_files,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=600,
    )
    said = " ".join(done.stdout.split())
    assert done.returncode == 2, done.stdout[-3000:]
    assert "Traceback" not in done.stdout and "SafetensorError" not in done.stdout
    assert f"cannot create '{run_dir / 'final'}'" in said and "exporting the model" in said, said
    assert f"the checkpoint of step 4 ({run_dir / 'checkpoints' / 'step-000004'}) is complete" in said
    assert "run the same command: it exports from that checkpoint" in said
    assert not [p.name for p in run_dir.iterdir() if p.name.startswith(".final")]  # the partial export went
    ends = [r for r in read_records(run_dir, "run") if r.get("event") == "end"]
    assert ends[-1]["status"] == "export_failed"  # report says how the run ended, not "running or killed"
    code, out = run(recipe)
    assert code == 0 and (run_dir / "final" / "config.json").is_file(), out


@pytest.mark.parametrize("ranks", ["every", "1"])
def test_a_full_disk_with_two_processes_is_said_once_without_traceback_or_torchrun_lines(write_recipe, ranks):
    """Every rank met the full disk: each printed the line (or rank 1, slower, found the partial save rank 0 had
    removed and ended in a RuntimeError traceback), and torchrun added 'failed (exitcode: 2) local_rank: 0 ...'.
    Rank 1 alone (a node-local disk, a quota): rank 0's barrier broke into a gloo traceback, and the
    partial save and the missing end record stayed."""
    import subprocess
    import sys

    from tests.train.test_run import clean_env

    recipe = write_recipe(
        f"full-two-{ranks}",
        {
            "hardware": {"gpus": 2},
            "batch": {"global_batch": 8, "micro_batch": 2},
            "train": {"steps": 6, "save_every": 2, "eval_every": 100},
        },
    )
    env = clean_env(
        OMP_NUM_THREADS="1", MEMTRAIN_INJECT_ENOSPC="4", **({} if ranks == "every" else {"MEMTRAIN_INJECT_RANK": ranks})
    )
    done = subprocess.run(
        [sys.executable, "-m", "memtrain", "run", str(recipe)],
        text=True,
        timeout=600,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert done.returncode == 2, done.stdout[-3000:]
    assert done.stdout.count("no space left on") == 1, done.stdout[-3000:]
    assert "Traceback" not in done.stdout and "failed (exitcode" not in done.stdout, done.stdout[-3000:]
    run_dir = run_dir_of(recipe)
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-000002"]  # no partial save left
    ends = [r["status"] for r in read_records(run_dir, "run") if r.get("event") == "end"]
    assert ends == ["disk_full" if ranks == "every" else "save_failed_on_another_rank"]


def test_a_worker_killed_with_sigkill_is_named_and_the_run_ends_with_the_peer_lost_code(write_recipe):
    """The survivor's collective breaks with gloo's "Connection reset by peer"; the run says which rank died and that
    the same command resumes, with exit 69 (EXIT_PEER_LOST), no traceback, within seconds."""
    import signal
    import time

    from memtrain.train.runtime.result import EXIT_PEER_LOST

    recipe, proc = start_two_process_run(write_recipe, "killed-rank")
    [victim] = [p for p in family(proc.pid) if p.cmdline()[-1:] and p.environ().get("RANK") == "1"]
    killed_at = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PEER_LOST, output[-3000:]
    assert time.monotonic() - killed_at < 30, output[-3000:]
    assert "Traceback" not in output and "Connection reset" not in output and "frame #" not in output, output[-3000:]
    said = [line for line in output.splitlines() if "rank 1 (node 0)" in line]
    assert len(said) == 1 and "killed by SIGKILL" in said[0] and "run the same command" in said[0], output[-3000:]


def test_a_damaged_newest_checkpoint_is_skipped_with_a_line_and_the_run_resumes_exactly_from_the_one_before(
    write_recipe,
):
    """64 KB of zeros in the newest checkpoint's model states loaded silently (the weights off by up to 4e-3), and a
    truncated one gave a zip-reader traceback at every rerun. The newest that verifies is resumed instead."""
    recipe = write_recipe("damaged", {"train": {"steps": 8, "save_every": 2, "keep_last": 3, "eval_every": 100}})
    assert run(recipe, max_steps=6)[0] == 0
    run_dir = run_dir_of(recipe)
    before = {r["step"]: r["loss"] for r in read_records(run_dir, "train")}
    [model] = (run_dir / "checkpoints" / "step-000006").rglob("mp_rank_00_model_states.pt")
    with open(model, "r+b") as handle:
        handle.seek(model.stat().st_size // 3)
        handle.write(b"\0" * min(65536, model.stat().st_size // 3))
    code, said = run(recipe)
    assert code == 0, said
    assert "skipped checkpoints that do not verify" in said and "step-000006 (state/mp_rank_00_model_states.pt" in said
    assert "resuming from step 4 (checkpoint" in said, said
    after = {r["step"]: r["loss"] for r in read_records(run_dir, "train")}
    assert sorted(after) == list(range(1, 9))
    assert [after[s] for s in (5, 6)] == [before[s] for s in (5, 6)]  # redone from step 4, exactly
    assert (run_dir / "checkpoints" / "corrupt-step-000006").is_dir()

    for checkpoint_dir in complete_checkpoints(run_dir):  # none verifies now: a line and exit 2, nothing moved
        (checkpoint_dir / "memtrain_state.json").write_text("{garbled")
    kept = [p.name for p in complete_checkpoints(run_dir)]
    refused = cli(recipe, "train.steps=12")
    assert refused.exit_code == 2, refused.output
    assert "no checkpoint in" in refused.output and "verifies" in refused.output
    assert "Traceback" not in refused.output and "JSONDecodeError" not in refused.output
    assert [p.name for p in complete_checkpoints(run_dir)] == kept


def test_a_diverged_run_keeps_its_last_checkpoint_from_before_the_loss_rose(write_recipe):
    """With lr 0.9 the loss is far above step 1's from step 2 on; pruning to keep_last=1 kept only diverged ones."""
    recipe = write_recipe(
        "diverged-kept",
        {
            "optimizer": {"lr": 0.9},
            "schedule": {"warmup_steps": 0},
            "train": {"steps": 8, "save_every": 1, "keep_last": 1, "eval_every": 100},
        },
    )
    code, said = run(recipe)
    assert code == 0, said
    run_dir = run_dir_of(recipe)
    losses = {r["step"]: r["loss"] for r in read_records(run_dir, "train")}
    assert min(losses, key=losses.get) == 1 and all(losses[s] > 1.5 * losses[1] for s in range(2, 9))
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step-000001", "step-000008"]
    assert "step 1, the best loss, is kept" in said.splitlines()[-1]
