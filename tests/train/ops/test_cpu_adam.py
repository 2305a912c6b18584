"""DeepSpeed's CPU Adam loaded in a background thread while the run starts (memtrain/train/ops/cpu_adam.py): it starts
without blocking, a failed build is said where the run waits for it (with the ways around it), and py-cpuinfo is
asked once per process."""

from __future__ import annotations

import threading

import cpuinfo
import pytest
from deepspeed.ops.op_builder import CPUAdamBuilder

from memtrain.errors import UserError
from memtrain.recipe.schema import Recipe
from memtrain.train.ops import cpu_adam
from memtrain.train.ops.cpu_adam import CpuAdamLoad
from memtrain.train.ops.deepspeed_ops import needs_cpu_adam


def _recipe(**offload) -> Recipe:
    return Recipe.model_validate(
        {"model": {"preset": "tiny"}, "data": {"train": "builtin:shakespeare"}, "offload": offload}
    )


def test_only_recipes_whose_optimizer_deepspeed_offloads_need_the_op():
    assert needs_cpu_adam(_recipe(optimizer="cpu"))
    assert not needs_cpu_adam(_recipe())
    assert not needs_cpu_adam(
        Recipe.model_validate(
            {**_recipe(optimizer="cpu").model_dump(exclude_unset=True), "optimizer": {"name": "paged_adamw_8bit"}}
        )
    )


def test_start_returns_while_the_op_loads_and_a_failed_build_is_said_with_the_ways_around_it(monkeypatch):
    started, may_finish = threading.Event(), threading.Event()

    def planted_load(self):
        started.set()
        if not may_finish.wait(timeout=30):
            raise AssertionError("start() waited for the load")
        raise RuntimeError("Error building extension 'cpu_adam'\n(the compiler's output)")

    monkeypatch.setattr(CPUAdamBuilder, "load", planted_load)
    load = CpuAdamLoad(_recipe(optimizer="cpu")).start()
    assert started.wait(timeout=30)  # the load runs...
    may_finish.set()  # ...while this thread goes on
    with pytest.raises(UserError) as raised:
        load.wait()
    [problem] = raised.value.problems
    assert problem.key == "offload.cpu_adam" and "Error building extension 'cpu_adam')" in problem.message
    assert "offload.cpu_adam=torch" in problem.hint and "compiler" in problem.hint
    load.wait()  # said once


def test_a_recipe_without_the_op_starts_no_thread(monkeypatch):
    monkeypatch.setattr(CPUAdamBuilder, "load", lambda self: pytest.fail("loaded an op the recipe does not use"))
    load = CpuAdamLoad(_recipe()).start()
    load.wait()
    assert load._thread is None


def test_cpu_info_is_asked_once_per_process_whatever_the_threads(monkeypatch):
    asked = []

    def ask():
        asked.append(threading.get_ident())
        return {"arch": "X86_64", "flags": ["avx2"]}

    monkeypatch.setattr(cpuinfo, "get_cpu_info", ask)
    cpu_adam.share_cpu_info()
    cpu_adam.share_cpu_info()  # a second call keeps the first shared function
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(cpuinfo.get_cpu_info())) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    from cpuinfo import get_cpu_info  # as DeepSpeed imports it, at each call

    answers.append(get_cpu_info())
    assert len(asked) == 1 and len(answers) == 5
    assert all(answer == {"arch": "X86_64", "flags": ["avx2"]} for answer in answers)
    answers[0]["arch"] = "changed"  # each caller gets its own copy
    assert get_cpu_info()["arch"] == "X86_64"
