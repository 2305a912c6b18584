"""How many cores a CPU run sizes its threads to: the affinity set, cut to a cgroup's quota."""

from __future__ import annotations

import os

import pytest

from memtrain.train.runtime.distributed import cgroup_cpu_quota, usable_cpus


@pytest.mark.parametrize(
    ("cpu_max", "cores"), [("200000 100000\n", 2.0), ("150000 100000\n", 1.5), ("max 100000\n", None)]
)
def test_cgroup_v2_quota_in_cores(tmp_path, cpu_max, cores):
    (tmp_path / "cpu.max").write_text(cpu_max)
    assert cgroup_cpu_quota(tmp_path) == cores


@pytest.mark.parametrize(("quota", "cores"), [("400000", 4.0), ("-1", None)])
def test_cgroup_v1_quota_in_cores(tmp_path, quota, cores):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(quota + "\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(tmp_path) == cores


def test_no_cgroup_files_mean_no_quota(tmp_path):
    assert cgroup_cpu_quota(tmp_path) is None


def test_a_quota_below_the_affinity_set_wins(monkeypatch):
    monkeypatch.setattr("memtrain.train.runtime.distributed.cgroup_cpu_quota", lambda: 1.5)
    assert usable_cpus() == min(2, len(os.sched_getaffinity(0)))
    monkeypatch.setattr("memtrain.train.runtime.distributed.cgroup_cpu_quota", lambda: None)
    assert usable_cpus() == len(os.sched_getaffinity(0))
