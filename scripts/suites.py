"""The benchmark suites and baselines of benchmarks/suites.yaml, read and checked.

A suite is a named list of cases a user would compare; each case names its kind (which measuring script runs
it), the recipe and overrides, the steps and a time budget. A baseline is a script that trains the same recipe
another way (scripts/bench_vs_hf.py runs memtrain, then each baseline a case names). Bad entries are refused
with the key path and what to write, before anything runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, model_validator

from scripts.bench_common import ROOT

SUITES_FILE = ROOT / "benchmarks" / "suites.yaml"
NAME = r"^[a-z0-9][a-z0-9.+-]*$"  # a case's name is a word for --only and, unless it has a label, its row's


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Baseline(Strict):
    """`python -m MODULE RECIPE [key=value ...] --steps N --warmup N --out RESULT.json ARGS...`, writing
    tokens_per_s, target_tokens_per_s, time_to_first_step_s, peak_reserved_gib and host_peak_rss_gib."""

    about: str
    module: str = Field(pattern=r"^[A-Za-z_][\w.]*$")
    args: tuple[str, ...] = ()


class Case(Strict):
    name: str = Field(pattern=NAME)
    # the row's label in the table, where it differs from the name (a row measured before keeps its label)
    label: str | None = Field(default=None, pattern=r"^[^\n]+$")
    about: str = ""
    budget_s: PositiveInt  # wall seconds the case may take, all its runs together
    run_timeout_s: PositiveInt | None = None  # one run's limit (memtrain's or a baseline's); default budget_s

    @property
    def timeout_s(self) -> int:
        return self.run_timeout_s or self.budget_s

    @property
    def row(self) -> str:
        """The label of the case's row in its table."""
        return self.label or self.name


class RecipeCase(Case):
    recipe: str
    overrides: tuple[str, ...] = ()


class LabelledSpec(RecipeCase):
    """A case its script reads as LABEL=RECIPE [key=value ...]: its label cannot hold '='."""

    @model_validator(mode="after")
    def _no_equals_in_label(self) -> LabelledSpec:
        if "=" in self.row:
            raise ValueError(f"{self.row!r}: the script reads the case as LABEL=RECIPE, so the label has no '='")
        return self


class VsBaselines(LabelledSpec):
    """memtrain and each baseline on the same recipe (scripts/bench_vs_hf.py, benchmarks/vs_hf.csv)."""

    kind: Literal["vs-hf"]
    memtrain_overrides: tuple[str, ...] = ()  # memtrain's levers only; the global batch must stay the same
    baselines: tuple[str, ...] = ("hf",)
    steps: PositiveInt
    warmup_steps: int = Field(ge=0)


class MemtrainRun(LabelledSpec):
    """memtrain alone: tokens/s, peaks, host memory (scripts/bench_run.py, benchmarks/runs.csv)."""

    kind: Literal["run"]
    steps: PositiveInt
    warmup_steps: int = Field(ge=0)
    # beside scripts/hold_gpu_memory.py (the card physically 24 GiB, for paged optimizer states that ignore
    # hardware.cap_memory) and scripts/sample_host_memory.py (machine-wide host memory, host-NAME.json)
    hold_gpu: bool = False
    # stop after this many steps with a checkpoint, then resume to `steps` in a second process: the row is the
    # resumed run's, and says how long the save took and whether the resume held (every other run passes --no-save)
    resume_at: PositiveInt | None = None

    @model_validator(mode="after")
    def _resumes_before_the_end(self) -> "MemtrainRun":
        if self.resume_at is not None and self.resume_at >= self.steps:
            raise ValueError(f"resume_at ({self.resume_at}) must be below steps ({self.steps})")
        return self


class Startup(RecipeCase):
    """Command to first optimizer step, per phase (scripts/bench_startup.py, benchmarks/startup.csv)."""

    kind: Literal["startup"]
    machine_state: Literal["fresh", "warm"]
    runs: PositiveInt = 1  # a warm row runs twice: the first fills the caches for its shapes, the second is the row
    prepare: bool = False  # `memtrain prepare` first, outside the time to first step
    steps: PositiveInt = 1

    @model_validator(mode="after")
    def _fresh_is_one_run(self) -> Startup:
        if self.machine_state == "fresh" and self.runs != 1:
            raise ValueError("a fresh start is the first run on empty caches: runs must be 1")
        return self


class PlanAccuracy(Case):
    """Predicted against measured peaks of a group of scripts/plan_accuracy.py's cases (benchmarks/plan_accuracy.csv):
    the group names the recipes, overrides and steps."""

    kind: Literal["plan-accuracy"]
    group: str
    only: tuple[str, ...] = ()  # the group's cases whose names contain one of these (default: all of them)
    parallel: PositiveInt = 1  # runs side by side, each under its own cap
    host_budget_gib: float = Field(default=105.0, gt=0)
    calibrate: bool = False


class Longest(RecipeCase):
    """The longest data.seq_len that trains, each method climbing the same lengths until one fails
    (scripts/bench_long_context.py, benchmarks/long_context.csv: one row per model and method)."""

    kind: Literal["longest"]
    model: str = Field(pattern=NAME)  # the table's model column: rows of one model, method by method
    methods: tuple[str, ...] = Field(default=("memtrain",), min_length=1)  # memtrain and baselines' names
    lengths: tuple[PositiveInt, ...] = Field(min_length=1)
    steps: PositiveInt
    warmup_steps: int = Field(ge=0)


AnyCase = Annotated[Union[VsBaselines, MemtrainRun, Startup, PlanAccuracy, Longest], Field(discriminator="kind")]


class Suite(Strict):
    about: str
    cases: tuple[AnyCase, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _names_once(self) -> Suite:
        names = [case.name for case in self.cases]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"case names must be unique in a suite: {', '.join(twice)} twice")
        return self


class Suites(Strict):
    baselines: dict[Annotated[str, Field(pattern=NAME)], Baseline]
    suites: dict[Annotated[str, Field(pattern=NAME)], Suite]

    @model_validator(mode="after")
    def _baselines_known(self) -> Suites:
        for suite_name, suite in self.suites.items():
            for case in suite.cases:
                named = getattr(case, "baselines", ()) + tuple(
                    m for m in getattr(case, "methods", ()) if m != "memtrain"
                )
                unknown = [b for b in named if b not in self.baselines]
                if unknown:
                    raise ValueError(
                        f"suites.{suite_name}, case {case.name}: no baseline {', '.join(unknown)}; "
                        f"the baselines are {', '.join(self.baselines)} (add one under `baselines:`)"
                    )
        return self


class SuitesError(Exception):
    """benchmarks/suites.yaml cannot be read: the message says where and what to write."""


def load_suites(path: Path = SUITES_FILE) -> Suites:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise SuitesError(f"{path}: cannot read it: {error}") from None
    try:
        return Suites.model_validate(data)
    except ValidationError as error:
        lines = [f"{path}: {error.error_count()} problem(s):"]
        for problem in error.errors():
            lines.append(f"  {_key_path(problem['loc'])}: {problem['msg']}")
        raise SuitesError("\n".join(lines)) from None


def _key_path(loc: tuple) -> str:
    """suites.offload.cases.1.steps: without the kind pydantic puts after a case's index (the union's branch)."""
    parts = [part for i, part in enumerate(loc) if not (i and isinstance(loc[i - 1], int) and part in KINDS)]
    return ".".join(str(part) for part in parts)


KINDS = ("vs-hf", "run", "startup", "plan-accuracy", "longest")
