"""scripts/bench.py and benchmarks/suites.yaml: every case of every suite names a real recipe that loads with its
overrides, and resolves to a command its measuring script accepts; --list and --dry-run say what would run; a bad
suites file or case name is a message and exit code 2. One small case really runs (CPU), end to end."""

from __future__ import annotations

import csv
import importlib
import importlib.util
import shlex
from pathlib import Path

import pytest

from memtrain.recipe.load import load_recipe
from scripts import bench, plan_accuracy
from scripts.bench_common import ROOT
from scripts.suites import MemtrainRun, PlanAccuracy, Startup, VsBaselines, load_suites

SUITES = load_suites()
CASES = [(suite, case) for suite, spec in SUITES.suites.items() for case in spec.cases]
MODULES = {"vs-hf": "scripts.bench_vs_hf", "run": "scripts.bench_run", "startup": "scripts.bench_startup"}
MODULES["plan-accuracy"] = "scripts.plan_accuracy"
MODULES["longest"] = "scripts.bench_long_context"


TINY = "[data.seq_len=32, batch.global_batch=2, batch.micro_batch=1, schedule.warmup_steps=0]"  # quickstart, seconds


def suite_file(tmp_path: Path, suite: str, about: str, cases: str) -> Path:
    """A suites file of one suite, no baselines: `cases` is the YAML of its case list, one `- {...}` a line."""
    path = tmp_path / "suites.yaml"
    path.write_text(f"baselines: {{}}\nsuites:\n  {suite}:\n    about: {about}\n    cases:\n{cases}")
    return path


def test_the_suites_a_user_compares_are_there():
    assert {"lora-vs-hf", "offload", "startup", "plan-accuracy", "levers", "chat"} <= set(SUITES.suites)
    assert {"hf", "hf-liger"} <= set(SUITES.baselines)


@pytest.mark.parametrize("suite, case", CASES, ids=[f"{suite}:{case.name}" for suite, case in CASES])
def test_each_case_names_a_recipe_that_loads_with_its_overrides(suite, case):
    if isinstance(case, PlanAccuracy):
        chosen = [c for c in plan_accuracy.GROUPS[case.group] if not case.only or any(p in c.name for p in case.only)]
        assert chosen, f"{suite}:{case.name} selects no case of group {case.group}"
        specs = [(c.recipe, plan_accuracy.case_overrides(c, "rtx3090", Path("/r"), Path("/n"))) for c in chosen]
    else:
        specs = [(case.recipe, list(case.overrides))]
    for recipe, overrides in specs:
        assert (ROOT / recipe).is_file(), recipe
        loaded = load_recipe(ROOT / recipe, overrides).recipe  # checked as `memtrain validate` checks it
        if isinstance(case, VsBaselines):  # memtrain's levers must leave both sides the same global batch
            ours = load_recipe(ROOT / recipe, overrides + list(case.memtrain_overrides)).recipe
            assert ours.batch.global_batch == loaded.batch.global_batch, case.name


def test_each_command_is_one_its_measuring_script_accepts(tmp_path):
    for suite, spec in SUITES.suites.items():
        for invocation in bench.invocations(list(spec.cases)):
            argv = bench.command(invocation, tmp_path)
            assert argv[1:3] == ["-m", MODULES[invocation.kind]]
            args = importlib.import_module(argv[2]).arguments().parse_args(argv[3:])
            assert args.out.parent == tmp_path, (suite, invocation.names)
            if isinstance(invocation.cases[0], VsBaselines):  # one --case per case, named as the case
                assert [c.partition("=")[0] for c in args.case] == [case.row for case in invocation.cases]
                for text in args.case:  # the script reads a case as NAME=RECIPE overrides [:: levers]
                    shared, _, _ = text.partition("=")[2].partition("::")
                    assert (ROOT / shlex.split(shared)[0]).is_file()


def test_each_baseline_is_a_script_there_is():
    for name, baseline in SUITES.baselines.items():
        assert importlib.util.find_spec(baseline.module) is not None, name


def test_a_row_in_two_suites_is_one_configuration():
    """A case writes the row of its label (or name) in its kind's table: two cases of one row would overwrite it."""
    seen: dict[tuple, object] = {}
    for suite, case in CASES:
        key = (case.kind, case.row, getattr(case, "machine_state", None))  # start-up rows: one per machine state
        if key in seen:
            assert case == seen[key], f"{case.row} means two things ({suite})"
        seen[key] = case
    assert len(seen) < len(CASES)  # the levers suite's reference row is the LoRA suite's


def test_the_accuracy_suite_measures_every_case_but_those_of_the_held_runs():
    measured = {
        c.name
        for _, case in CASES
        if isinstance(case, PlanAccuracy)
        for c in plan_accuracy.GROUPS[case.group]
        if not case.only or any(part in c.name for part in case.only)
    }
    left = {case.name for case in plan_accuracy.CASES} - measured
    assert left == {
        "7b-full-in-backward-paged8bit-mb8-s1024",
        "7b-full-in-backward-paged8bit-mb16-s1024",
        "7b-qlora-nf4-compiled-ligerloss-every-mb8-s1024",  # refused now: compiled layers over quantised weights
    }
    held = [c for _, c in CASES if isinstance(c, MemtrainRun) and c.hold_gpu]
    assert "recipes/llama2-7b-full-32gb-host.yaml" in {c.recipe for c in held}  # where those rows come from


def test_levers_share_one_invocation_and_the_baselines_run_once():
    [invocation] = bench.invocations(list(SUITES.suites["levers"].cases))
    assert invocation.names[0] == "7b-lora" and len(invocation.names) == 4
    assert invocation.budget_s == sum(case.budget_s for case in SUITES.suites["levers"].cases)
    families = bench.invocations(list(SUITES.suites["families-vs-hf"].cases))
    assert len(families) == len(SUITES.suites["families-vs-hf"].cases)  # other recipes: each its own baselines


def test_a_warm_start_up_runs_twice_and_a_fresh_one_once(tmp_path):
    for _, case in CASES:
        if isinstance(case, Startup):
            argv = bench.command(bench.Invocation(case.kind, [case]), tmp_path)
            assert argv.count("--recipe") == (2 if case.machine_state == "warm" else 1), case.name


def test_list_names_the_suites_and_a_suites_cases(capsys):
    assert bench.main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in SUITES.suites)
    assert bench.main(["levers", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(case.name in listed for case in SUITES.suites["levers"].cases)


def test_dry_run_prints_each_command_and_runs_nothing(capsys, tmp_path):
    assert bench.main(["offload", "--dry-run", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    commands = [line for line in lines if line.startswith("python -m scripts.bench_vs_hf")]
    assert len(commands) == 2 and "--baseline hf,hf-liger" in commands[0]
    assert ":: batch.micro_batch=auto" in commands[0]
    assert not list(tmp_path.iterdir())
    assert bench.main(["levers", "--dry-run", "--only", "7b-lora-zero2"]) == 0
    [command] = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert command.count("--case") == 1 and "offload.zero_stage=2" in command


def test_an_unknown_suite_or_case_is_a_message_and_exit_2(capsys):
    assert bench.main(["no-such-suite", "--dry-run"]) == 2
    assert "no suite no-such-suite; the suites are lora-vs-hf" in capsys.readouterr().err
    assert bench.main(["levers", "--only", "7b-lora,7b-lora-zero3"]) == 2
    err = capsys.readouterr().err
    assert "suite levers has no case 7b-lora-zero3" in err and "7b-lora-zero2" in err


def test_a_bad_suites_file_says_where_and_exits_2(tmp_path, capsys):
    text = (ROOT / "benchmarks" / "suites.yaml").read_text()
    bad = tmp_path / "suites.yaml"
    bad.write_text(text.replace("baselines: [hf]", "baselines: [hf, no-such-baseline]").replace("steps: 6", "stepz: 6"))
    assert bench.main(["--suites", str(bad), "--list"]) == 2
    err = capsys.readouterr().err
    assert "suites.offload.cases.1.stepz: Extra inputs are not permitted" in err
    assert "suites.offload.cases.1.steps: Field required" in err
    bad.write_text(text.replace("baselines: [hf]", "baselines: [hf, no-such-baseline]"))
    assert bench.main(["--suites", str(bad), "--list"]) == 2
    err = capsys.readouterr().err
    assert "case 3b-full-offload-mb-auto: no baseline no-such-baseline; the baselines are hf, hf-liger" in err


@pytest.mark.slow  # one memtrain run of the quickstart recipe on the CPU (~30 s on two cores, more if
# DeepSpeed's CPU ops are built first: the budget leaves room for that)
def test_a_run_case_appends_its_row_to_a_copy_of_the_committed_table(tmp_path, capsys):
    suites = suite_file(
        tmp_path,
        "tiny",
        "the quickstart recipe for three steps",
        f"      - {{name: quickstart-tiny, kind: run, recipe: recipes/quickstart.yaml, overrides: {TINY},\n"
        "         steps: 3, warmup_steps: 1, budget_s: 900}\n"
        f"      - {{name: not-in-the-budget, kind: run, recipe: recipes/quickstart.yaml, overrides: {TINY},\n"
        "         steps: 3, warmup_steps: 1, budget_s: 2000}\n",
    )
    out = tmp_path / "out"
    assert bench.main(["tiny", "--suites", str(suites), "--out", str(out), "--budget-s", "1200"]) == 0
    said = capsys.readouterr().out
    assert "skipped (the budget left was too short): not-in-the-budget" in said
    assert "python -m scripts.bench tiny --only not-in-the-budget" in said
    committed = list(csv.DictReader((ROOT / "benchmarks" / "runs.csv").open()))
    rows = list(csv.DictReader((out / "runs.csv").open()))
    assert rows[: len(committed)] == committed and len(rows) == len(committed) + 1
    row = rows[-1]
    assert row["recipe"] == "quickstart-tiny" and row["status"] == "ok" and row["steps"] == "3"
    assert row["command"].startswith("memtrain run recipes/quickstart.yaml data.seq_len=32") and row["machine"]
    assert row["date"] and float(row["tokens_per_s"]) > 0
    assert "| quickstart-tiny |" in (out / "runs.md").read_text()


@pytest.mark.slow  # two memtrain runs of the quickstart recipe on the CPU (~30 s each on two cores)
def test_a_resumed_case_saves_stops_and_resumes_in_a_second_process(tmp_path, capsys):
    """The row is the resumed run's: its steps only, the save's seconds, and ok only where it resumed at the step."""
    suites = suite_file(
        tmp_path,
        "tiny",
        "the quickstart recipe saved at step 2 and resumed to step 3",
        f"      - {{name: quickstart-resumed, kind: run, recipe: recipes/quickstart.yaml, overrides: {TINY},\n"
        "         steps: 3, resume_at: 2, warmup_steps: 0, budget_s: 900}\n",
    )
    out = tmp_path / "out"
    assert bench.main(["tiny", "--suites", str(suites), "--out", str(out)]) == 0
    row = list(csv.DictReader((out / "runs.csv").open()))[-1]
    assert row["recipe"] == "quickstart-resumed" and row["status"] == "ok" and row["steps"] == "1"
    assert float(row["save_s"]) >= 0 and float(row["tokens_per_s"]) > 0
    assert row["command"].endswith("train.save_every=2 --max-steps 2, then again with --resume")


def test_a_resume_must_come_before_the_last_step(tmp_path, capsys):
    suites = suite_file(
        tmp_path,
        "tiny",
        "a resume after the end",
        "      - {name: late, kind: run, recipe: recipes/quickstart.yaml, steps: 3, resume_at: 3, warmup_steps: 0,\n"
        "         budget_s: 60}\n",
    )
    assert bench.main(["--suites", str(suites), "--list"]) == 2
    assert "suites.tiny.cases.0: Value error, resume_at (3) must be below steps (3)" in capsys.readouterr().err


def test_a_held_run_whose_gpu_memory_holder_cannot_start_is_not_run(tmp_path, capsys):
    """Without the holder a paged optimizer would find the whole card free: the row would measure another card."""
    suites = suite_file(
        tmp_path,
        "held",
        "one run beside the GPU memory holder",
        "      - {name: quickstart-held, kind: run, recipe: recipes/quickstart.yaml, steps: 1, warmup_steps: 0,\n"
        "         hold_gpu: true, budget_s: 60}\n",
    )
    out = tmp_path / "out"
    environment = bench.child_environment()
    environment["CUDA_VISIBLE_DEVICES"] = ""  # no card to hold, whatever the machine has
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench, "child_environment", lambda: environment)
        assert bench.main(["held", "--suites", str(suites), "--out", str(out)]) == 1
    said = capsys.readouterr().out
    assert "the GPU memory holder did not start" in said and "did not finish cleanly: quickstart-held" in said
    assert "quickstart-held" not in (out / "runs.csv").read_text()  # the run never started
    assert (out / "host_memory" / "hold-quickstart-held.txt").exists()  # what the holder said, to read


def test_the_long_context_suite_runs_each_recipe_at_its_length_and_at_4k_and_climbs_to_the_longest(capsys, tmp_path):
    assert bench.main(["long-context", "--dry-run", "--out", str(tmp_path)]) == 0
    said = capsys.readouterr().out
    for recipe, length in (("llama3-8b-qlora-long-24gb", 65536), ("qwen2.5-7b-lora-long-24gb", 32768)):
        runs = [line for line in said.splitlines() if "scripts.bench_run" in line and recipe in line]
        assert len(runs) == 2 and sum("data.seq_len=4096" in line for line in runs) == 1
        assert load_recipe(ROOT / "recipes" / f"{recipe}.yaml").recipe.data.seq_len == length
    climbs = [line for line in said.splitlines() if "scripts.bench_long_context" in line]
    assert any("--methods memtrain" in line for line in climbs)
    assert any("--methods hf " in line for line in climbs) and any("--methods hf-liger" in line for line in climbs)
    assert all(f"--out {tmp_path}/long_context.csv" in line for line in climbs)


@pytest.mark.slow  # one memtrain run of the quickstart recipe on the CPU (~30 s on two cores)
def test_the_longest_ladder_keeps_the_longest_length_that_trained_and_stops_at_the_first_that_fails(tmp_path, capsys):
    from scripts import bench_long_context

    out = tmp_path / "long_context.csv"
    spec = "recipes/quickstart.yaml batch.global_batch=2 batch.micro_batch=1 schedule.warmup_steps=0"
    # 4096 is beyond the quickstart model's 2048 positions: the run refuses it (exit 2), the ladder ends there
    argv = ["--out", str(out), "--name", "quickstart", "--recipe", spec, "--methods", "memtrain"]
    argv += ["--lengths", "4096,32,8192", "--steps", "3", "--warmup", "1", "--runs", str(tmp_path / "runs")]
    assert bench_long_context.main(argv) == 0
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 1
    row = rows[0]
    assert (row["model"], row["method"], row["longest_seq_len"]) == ("quickstart", "memtrain", "32")
    # 8192 is not tried after 4096 failed; the row says why in the refusal's words (out of memory where it was)
    assert row["failed_at"].startswith("4096 (") and "beyond the model's 2048 positions" in row["failed_at"]
    assert float(row["tokens_per_s"]) > 0 and row["peak_reserved_gib"] and row["machine"] and row["date"]
    assert (
        "--methods memtrain" in row["command"]
        and "| quickstart | memtrain | 32 |" in out.with_suffix(".md").read_text()
    )
