"""The CPUs a pod may use (spotrl_runtime/cpus.py), from its cgroup's quota (v2 and v1) and its
affinity, at least 1: how many reward processes an unset ``spec.reward.workers`` starts (at most
8), and the CPUs the controller's Ray offers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spotrl_runtime.cpus import (
    MAX_DEFAULT_WORKERS,
    cgroup_cpus,
    default_workers,
    parse_cfs,
    parse_cpu_max,
    pod_cpus,
)

AFFINITY = len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("200000 100000\n", 2.0), ("150000 100000", 1.5), ("max 100000\n", None), ("", None), ("x 100000", None)],
)
def test_cgroup_v2_cpu_max(text: str, cpus: float | None) -> None:
    assert parse_cpu_max(text) == cpus


@pytest.mark.parametrize(
    ("quota", "period", "cpus"), [("400000\n", "100000\n", 4.0), ("-1\n", "100000\n", None), ("", "100000", None)]
)
def test_cgroup_v1_cfs_quota(quota: str, period: str, cpus: float | None) -> None:
    assert parse_cfs(quota, period) == cpus


def _v2(root: Path, text: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cpu.max").write_text(text)
    return root


def _v1(root: Path, quota: str) -> Path:
    (root / "cpu").mkdir(parents=True, exist_ok=True)
    (root / "cpu" / "cpu.cfs_quota_us").write_text(quota)
    (root / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    return root


def test_the_pods_cpus_are_its_quota_rounded_up_within_its_affinity(tmp_path: Path) -> None:
    assert cgroup_cpus(_v2(tmp_path / "a", "50000 100000\n")) == 0.5
    assert pod_cpus(_v2(tmp_path / "b", "50000 100000\n")) == 1, "half a CPU still runs one process"
    assert pod_cpus(_v2(tmp_path / "g", "150000 100000\n")) == min(2, AFFINITY), "1.5 CPUs run two, part of the time"
    assert pod_cpus(_v2(tmp_path / "c", "max 100000\n")) == AFFINITY, "no limit: the CPUs it may run on"
    assert pod_cpus(_v2(tmp_path / "d", f"{100000 * (AFFINITY + 8)} 100000")) == AFFINITY, "never past its affinity"
    assert pod_cpus(_v1(tmp_path / "e", "100000\n")) == 1
    assert pod_cpus(_v1(tmp_path / "f", "-1\n")) == AFFINITY
    assert pod_cpus(tmp_path / "no-cgroup") == AFFINITY


def test_the_default_is_one_worker_per_cpu_from_1_to_8() -> None:
    assert [default_workers(n) for n in (0, 1, 2, 7, 8, 9, 64)] == [1, 1, 2, 7, 8, 8, 8]
    assert MAX_DEFAULT_WORKERS == 8
    assert 1 <= default_workers() <= min(AFFINITY, 8)


def test_the_controllers_ray_offers_the_pods_cpus_not_the_nodes(tmp_path: Path) -> None:
    from spotrl_runtime.generation.cluster import controller_ray_cpus

    one_cpu = _v2(tmp_path / "limit", "100000 100000\n")  # a pod limited to 1 CPU, on a node of AFFINITY
    assert controller_ray_cpus(False, None, one_cpu) == 1
    assert controller_ray_cpus(False, None, tmp_path / "no-cgroup") == AFFINITY
    assert controller_ray_cpus(False, 3, one_cpu) == 3, "a number given is kept"
    assert controller_ray_cpus(True, None, one_cpu) == 0, "remote workers: no generation actor beside the trainer"
