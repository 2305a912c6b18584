"""`memtrain report`: plots and summary from the metrics.jsonl of a real (tiny) training run."""

from __future__ import annotations

import gzip
import io
import json
import math
import resource
import shutil
import struct
import time
from pathlib import Path

import matplotlib.image
import numpy as np
import psutil
import pytest
import torch
from rich.console import Console
from tokenizers import Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from memtrain.commands.report import report_command
from memtrain.errors import UserError
from memtrain.monitor.metrics import GENERATION_KIND, MetricsLog, read_metrics
from memtrain.monitor.plots import DPI, FIGURE_SIZE_INCHES, PLOT_FILES
from memtrain.monitor.report import summarize
from memtrain.monitor.series import series, steady_speeds, throughput
from memtrain.monitor.startup import StartupClock

ASSETS = Path(__file__).resolve().parents[2] / "memtrain" / "assets"
SEQ_LEN = 32
STEPS = 8
EVAL_EVERY = 4
GRAD_ACCUM = 2


def _token_ids(split: str, max_chars: int) -> torch.Tensor:
    tokenizer = Tokenizer.from_file(str(ASSETS / "tokenizer" / "shakespeare" / "tokenizer.json"))
    with gzip.open(ASSETS / "corpus" / "shakespeare" / f"{split}.txt.gz", "rt", encoding="utf-8") as file:
        text = file.read(max_chars)
    ids = torch.tensor(tokenizer.encode(text).ids)
    usable = (len(ids) // SEQ_LEN) * SEQ_LEN
    return ids[:usable].view(-1, SEQ_LEN)


def _train_tiny_run(run_dir: Path) -> None:
    """A few AdamW steps of a tiny Llama on Shakespeare, logging the way the trainer loop does."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=4096,
        max_position_embeddings=SEQ_LEN,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train_ids, val_ids = _token_ids("train", 40_000), _token_ids("validation", 8_000)
    micro_batch, cursor, tokens, targets = 2, 0, 0, 0
    with MetricsLog(run_dir / "metrics.jsonl", flush_every=3) as log:
        log.event(
            "run", 0, event="start", recipe="tiny-test", plan_peak_reserved_bytes=None, gpu_cap_bytes=0, device="cpu"
        )
        for step in range(1, STEPS + 1):
            start = time.perf_counter()
            loss_sum = torch.zeros(())
            for _ in range(GRAD_ACCUM):
                batch = train_ids[cursor : cursor + micro_batch]
                cursor += micro_batch
                loss = model(input_ids=batch, labels=batch).loss / GRAD_ACCUM
                loss.backward()
                loss_sum += loss.detach()
                tokens += batch.numel()  # text windows: every position a real token, no padding
                targets += batch.numel() - batch.shape[0]  # every position but the first of each row
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step_time_s = time.perf_counter() - start
            rss = psutil.Process().memory_info().rss
            log.record(
                "train",
                step,
                loss=loss_sum,
                lr=3e-3,
                grad_norm=grad_norm,
                tokens=tokens,
                target_tokens=targets,
                padded_tokens=tokens,
                tokens_per_s=(GRAD_ACCUM * micro_batch * SEQ_LEN) / step_time_s,
                step_time_s=step_time_s,
                micro_batch=micro_batch,
                grad_accum=GRAD_ACCUM,
                gpu_allocated_bytes=0,
                gpu_reserved_bytes=0,
                gpu_peak_allocated_bytes=0,
                gpu_peak_reserved_bytes=0,
                gpu_cap_bytes=0,
                host_rss_bytes=rss,
                host_peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            )
            if step % EVAL_EVERY == 0:
                with torch.no_grad():
                    eval_loss = model(input_ids=val_ids[:8], labels=val_ids[:8]).loss.item()
                log.event("eval", step, loss=eval_loss, perplexity=math.exp(eval_loss))
                checkpoint = run_dir / f"step-{step}.pt"
                torch.save(model.state_dict(), checkpoint)
                log.event("checkpoint", step, path=str(checkpoint))
            if step == 5:
                log.event("batch", step, old_micro_batch=2, new_micro_batch=3, reason="under 70% for 5 steps")
                micro_batch = 3
        log.event("run", STEPS, event="end", status="done")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("tiny-run")
    _train_tiny_run(run_dir)
    return run_dir


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    return copy


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _report(run_dir: Path, as_json: bool = False) -> str:
    buffer = io.StringIO()
    assert report_command(run_dir, as_json=as_json, console=Console(file=buffer, width=160)) == 0
    return buffer.getvalue()


@pytest.mark.slow  # 5-20 s on two cores: plain pytest stays under 2 minutes; scripts/test.sh (CI) runs it
def test_report_renders_five_readable_pngs(tiny_run, tmp_path):
    run_dir = _copy(tiny_run, tmp_path)
    _report(run_dir)
    expected_size = (round(FIGURE_SIZE_INCHES[0] * DPI), round(FIGURE_SIZE_INCHES[1] * DPI))
    for name in PLOT_FILES:
        path = run_dir / name
        assert _png_size(path) == expected_size, name
        pixels = matplotlib.image.imread(path)[..., :3]
        assert pixels.shape[:2] == (expected_size[1], expected_size[0])
        not_white = np.any(pixels < 0.95, axis=-1).mean()
        colours = len(np.unique((pixels * 255).astype(np.uint8).reshape(-1, 3), axis=0))
        assert not_white > 0.02, f"{name} is nearly blank ({not_white:.1%} drawn)"
        assert colours > 20, f"{name} has only {colours} colours"


def test_summary_numbers_equal_those_in_the_metrics_file(tiny_run):
    records = read_metrics(tiny_run / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    best = min(evals, key=lambda r: r["perplexity"])
    summary = summarize(tiny_run)

    assert summary["steps"] == STEPS == train[-1]["step"]
    assert summary["tokens"] == train[-1]["tokens"] == GRAD_ACCUM * SEQ_LEN * (2 * 5 + 3 * 3)
    assert summary["target_tokens"] == train[-1]["target_tokens"] == GRAD_ACCUM * (SEQ_LEN - 1) * (2 * 5 + 3 * 3)
    assert summary["padding_share"] == 0.0 and not summary["tokens_are_targets"]
    assert summary["final_loss"] == train[-1]["loss"]
    assert summary["best_eval_perplexity"] == best["perplexity"]
    assert summary["best_eval_step"] == best["step"]
    assert summary["wall_time_s"] == pytest.approx(records[-1]["time"] - records[0]["time"])
    # The kernel's high-water mark (ru_maxrss) can lag a fresh RSS sample, so the peak is the larger of both.
    assert summary["peak_host_rss_bytes"] == max(max(r["host_peak_rss_bytes"], r["host_rss_bytes"]) for r in train)
    assert summary["peak_gpu_reserved_bytes"] is None  # a CPU run records zeros
    assert summary["final_micro_batch"] == 3 and summary["batch_changes"] == 1
    assert summary["status"] == "done" and summary["name"] == "tiny-test" and summary["device"] == "cpu"
    assert summary["checkpoints"] == [r["path"] for r in records if r["kind"] == "checkpoint"]
    assert summary["oom_count"] == 0 and summary["unreadable_lines"] == 0
    # The loss went down on real text, so the numbers are from a real run, not constants.
    assert train[-1]["loss"] < train[0]["loss"]


def test_json_output_is_the_summary_plus_plot_paths(tiny_run, tmp_path):
    run_dir = _copy(tiny_run, tmp_path)
    printed = json.loads(_report(run_dir, as_json=True))
    assert printed["plots"] == [str(run_dir / name) for name in PLOT_FILES]
    del printed["plots"]
    assert printed == json.loads(json.dumps(summarize(run_dir)))


def test_table_names_the_numbers_people_ask_for(tiny_run, tmp_path):
    run_dir = _copy(tiny_run, tmp_path)
    summary = summarize(run_dir)
    text = _report(run_dir)
    assert f"{summary['best_eval_perplexity']:.3f} (step {summary['best_eval_step']})" in text
    assert f"{summary['final_loss']:.4f}" in text
    assert f"{summary['tokens']:,}" in text


def test_killed_run_with_a_torn_last_line_still_reports(tiny_run, tmp_path):
    run_dir = _copy(tiny_run, tmp_path)
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_bytes().splitlines(keepends=True)
    last_train = max(i for i, line in enumerate(lines) if b'"kind": "train"' in line)
    # Killed while writing the last train record: everything after it is gone, it is half there.
    metrics.write_bytes(b"".join(lines[:last_train]) + lines[last_train][: len(lines[last_train]) // 2])

    summary = summarize(run_dir)
    complete = [r for r in read_metrics(metrics) if r["kind"] == "train"]
    assert summary["unreadable_lines"] == 1
    assert summary["steps"] == complete[-1]["step"] < STEPS
    assert summary["status"] == "running or killed"
    text = _report(run_dir)
    assert "running or killed" in text and "skipped 1 unreadable line" in text
    assert all((run_dir / name).is_file() for name in PLOT_FILES)


def test_resumed_run_keeps_the_newest_record_of_each_step(tiny_run, tmp_path):
    run_dir = _copy(tiny_run, tmp_path)
    # A resume from the step-4 checkpoint repeats steps 5.. with new numbers.
    with MetricsLog(run_dir / "metrics.jsonl", flush_every=1) as log:
        log.event("run", 4, event="resume", recipe="tiny-test", device="cpu")
        log.record("train", 5, loss=torch.tensor(1.25), tokens=999, micro_batch=3, grad_accum=2)
    steps, losses = series(read_metrics(run_dir / "metrics.jsonl"), "train", "loss")
    assert steps == list(range(1, STEPS + 1))
    assert losses[4] == 1.25
    summary = summarize(run_dir)
    assert summary["starts"] == 2 and summary["steps"] == STEPS


def _startup_record(log: MetricsLog, step: int, phase_ends_s: dict[str, float]) -> None:
    """A start-up record as the loop writes it, from a clock whose phases end at the given seconds."""
    ticks = iter(phase_ends_s.values())
    clock = StartupClock(origin_s=0.0, now=lambda: next(ticks))
    for name in phase_ends_s:
        clock.mark(name)
    log.event("startup", step, **clock.record())


def test_the_latest_start_up_is_reported_with_its_longest_phases(tiny_run, tmp_path):
    run_dir = _copy(tiny_run, tmp_path)
    [line] = [line for line in _report(run_dir).splitlines() if "command to first step" in line]
    assert summarize(run_dir)["first_step_s"] is None and line.strip(" │┃|").endswith("-")
    with MetricsLog(run_dir / "metrics.jsonl", flush_every=1) as log:
        _startup_record(log, 1, {"launch": 9.0, "model": 20.0, "deepspeed_init": 41.0, "first_step": 50.0})
        log.event("run", 4, event="resume", recipe="tiny-test", device="cpu")  # a resumed run starts again
        _startup_record(
            log, 5, {"launch": 7.0, "model": 9.5, "loaders": 16.5, "deepspeed_init": 18.0, "first_step": 21.0}
        )
    summary = summarize(run_dir)
    assert summary["first_step_s"] == 21.0
    assert summary["startup_phases_s"] == {
        "launch": 7.0,
        "model": 2.5,
        "loaders": 7.0,
        "deepspeed_init": 1.5,
        "first_step": 3.0,
    }
    assert "21.0 s (longest: launch 7.0 s, loaders 7.0 s, first step 3.0 s)" in _report(run_dir)


def test_the_held_out_exact_match_is_reported_from_its_first_to_its_last_score(tiny_run, tmp_path):
    """The generation evaluation's records (train.eval_generate) were in metrics.jsonl, not in the report."""
    run_dir = _copy(tiny_run, tmp_path)
    [line] = [line for line in _report(run_dir).splitlines() if "held-out exact match" in line]
    assert summarize(run_dir)["final_exact_match"] is None and "train.eval_generate is off" in line
    with MetricsLog(run_dir / "metrics.jsonl", flush_every=1) as log:
        for step, correct in ((0, 0), (4, 1), (8, 1)):
            log.event(
                GENERATION_KIND,
                step,
                exact_match=correct / 12,
                correct=correct,
                total=12,
                skipped=0,
                by_task={},
                samples=[],
            )
    summary = summarize(run_dir)
    assert (summary["first_exact_match"], summary["first_exact_match_step"]) == (0.0, 0)
    assert (summary["final_exact_match"], summary["final_exact_match_step"], summary["exact_match_answers"]) == (
        pytest.approx(1 / 12),
        8,
        12,
    )
    assert "0.000 at step 0 → 0.083 at step 8 (12 answers)" in _report(run_dir)


def test_oom_snapshots_are_named_in_the_report(tiny_run, tmp_path):
    run_dir = _copy(tiny_run, tmp_path)
    snapshot = run_dir / "oom-step-6.pickle"
    with MetricsLog(run_dir / "metrics.jsonl", flush_every=1) as log:
        log.event("oom", 6, micro_batch=3, snapshot=snapshot)
        log.event("oom", 7, micro_batch=2, snapshot=None)
    summary = summarize(run_dir)
    assert summary["oom_count"] == 2
    assert summary["oom_snapshots"] == [str(snapshot)]
    text = _report(run_dir)
    assert str(snapshot) in text
    assert "OOM at step 7 with micro-batch 2: no snapshot" in text


def test_speed_is_derived_from_tokens_and_step_time_when_not_recorded(tiny_run):
    records = [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in read_metrics(tiny_run / "metrics.jsonl")]
    train = {r["step"]: r for r in records if r["kind"] == "train"}
    steps, speeds = throughput(records)
    assert steps == list(range(2, STEPS + 1))
    for step, speed in zip(steps, speeds):
        new_tokens = train[step]["tokens"] - train[step - 1]["tokens"]
        assert speed == pytest.approx(new_tokens / train[step]["step_time_s"])
        assert speed == pytest.approx(
            next(
                r["tokens_per_s"]
                for r in read_metrics(tiny_run / "metrics.jsonl")
                if r["kind"] == "train" and r["step"] == step
            )
        )


def test_the_median_speed_leaves_out_each_starts_first_step_and_nothing_else(tmp_path):
    """A fresh run's speeds start at step 2 (a speed needs the step before): step 2 is an ordinary step and counts.
    A resume's first step (4 here) carries its warm-up and does not."""
    with MetricsLog(tmp_path / "metrics.jsonl", flush_every=1) as log:
        log.event("run", 0, event="start", recipe="r")
        for step, tokens in ((1, 100), (2, 200), (3, 300)):
            log.record("train", step, tokens=tokens, step_time_s=1.0)
        log.event("run", 3, event="resume", recipe="r")
        for step, tokens in ((4, 310), (5, 400)):
            log.record("train", step, tokens=tokens, step_time_s=1.0)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert throughput(records) == ([2, 3, 4, 5], [100.0, 100.0, 10.0, 90.0])
    assert steady_speeds(records) == [100.0, 100.0, 90.0]
    assert summarize(tmp_path)["median_tokens_per_s"] == 100.0  # was 90: step 2 left out, step 4 kept


def _chat_like_run(run_dir: Path, with_counts: bool) -> None:
    """Train records as the loop writes them for packed chat rows (real tokens, targets, positions computed), or as
    it wrote them before the three counts (`tokens` alone, counting targets)."""
    with MetricsLog(run_dir / "metrics.jsonl", flush_every=1) as log:
        log.event("run", 0, event="start", recipe="chat")
        for step in range(1, 5):
            counts = {"tokens": 900 * step, "target_tokens": 300 * step, "padded_tokens": 1000 * step}
            if with_counts:
                log.record("train", step, tokens_per_s=900.0, step_time_s=1.0, **counts)
            else:
                log.record("train", step, tokens=counts["target_tokens"], step_time_s=1.0)


def test_the_report_gives_real_tokens_targets_and_padding(tmp_path):
    _chat_like_run(tmp_path, with_counts=True)
    summary = summarize(tmp_path)
    assert (summary["tokens"], summary["target_tokens"], summary["padded_tokens"]) == (3600, 1200, 4000)
    assert summary["padding_share"] == pytest.approx(0.1)
    assert summary["median_tokens_per_s"] == 900.0 and summary["median_target_tokens_per_s"] == 300.0
    text = _report(tmp_path)
    assert "tokens (real, no padding)" in text and "3,600" in text and "1,200" in text
    assert "10.0% of 4,000 positions computed" in text
    assert "900 tokens/s (300 target tokens/s)" in text


def test_a_metrics_file_from_before_the_three_counts_still_reads_as_targets(tmp_path):
    _chat_like_run(tmp_path, with_counts=False)
    summary = summarize(tmp_path)
    assert summary["tokens_are_targets"] and summary["tokens"] == summary["target_tokens"] == 1200
    assert summary["padding_share"] is None and summary["padded_tokens"] is None
    assert summary["median_tokens_per_s"] == summary["median_target_tokens_per_s"] == 300.0
    text = _report(tmp_path)
    assert "target tokens (the loss's)" in text and "300 target tokens/s" in text and "real" not in text


def test_checkpoints_that_keep_last_removed_are_not_listed(tiny_run, tmp_path):
    run_dir = _copy(tiny_run, tmp_path)
    paths = [r["path"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "checkpoint"]
    listed = [str(run_dir / Path(p).name) for p in paths]
    text = (run_dir / "metrics.jsonl").read_text()
    for old, new in zip(paths, listed):
        text = text.replace(old, new)
    (run_dir / "metrics.jsonl").write_text(text)
    Path(listed[0]).unlink()
    assert summarize(run_dir)["checkpoints"] == listed[1:]


def test_missing_run_dir_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        summarize(tmp_path / "nope")


def test_run_dir_without_metrics_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no metrics.jsonl"):
        report_command(tmp_path, as_json=False, console=Console(file=io.StringIO()))


def test_metrics_with_no_complete_record_is_a_user_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "st')
    with pytest.raises(UserError, match="no complete records"):
        summarize(tmp_path)


def test_cli_exits_2_with_a_message_for_a_missing_run(tmp_path):
    from typer.testing import CliRunner

    from memtrain.cli import app

    result = CliRunner().invoke(app, ["report", str(tmp_path / "missing")])
    assert result.exit_code == 2
    assert "does not exist" in result.output


def test_a_record_whose_step_is_not_a_number_is_skipped_and_named_by_its_line(tiny_run, tmp_path):
    run_dir = _copy(tiny_run, tmp_path)
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    spoiled = next(i for i, line in enumerate(lines) if '"kind": "train"' in line and '"step": 3,' in line)
    lines[spoiled] = lines[spoiled].replace('"step": 3,', '"step": "three",')
    lines.insert(1, '{"kind": "train", "step": true, "loss": 1.0}\n')  # a bool is not a step either
    metrics.write_text("".join(lines))

    summary = summarize(run_dir)
    assert summary["unreadable_lines"] == 2
    assert summary["unreadable_at"] == ["metrics.jsonl:2", f"metrics.jsonl:{spoiled + 2}"]
    assert summary["steps"] == STEPS
    text = _report(run_dir)
    assert f"skipped 2 unreadable line(s) (metrics.jsonl:2, metrics.jsonl:{spoiled + 2}:" in text, text
