"""The CPUs this pod may use: how many reward processes a controller starts when
``spec.reward.workers`` is unset (at most :data:`MAX_DEFAULT_WORKERS`), and the CPUs the
controller's Ray offers (one worker process is started per CPU it offers).

A pod's CPU limit is a cgroup quota (``cpu.max`` in cgroup v2, ``cpu.cfs_quota_us`` over
``cpu.cfs_period_us`` in v1), not fewer CPUs: ``os.cpu_count()`` is the node's. The CPUs the
pod may run on (its affinity, which a static CPU manager narrows) bound it too.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

MAX_DEFAULT_WORKERS = 8
"""The default's cap: each process holds the reward and what it imports (math-verify and sympy:
about 100 MB), and the controller's own threads need CPUs too. More is set by hand."""

CGROUP = Path("/sys/fs/cgroup")


def parse_cpu_max(text: str) -> float | None:
    """CPUs of cgroup v2's ``cpu.max`` (``"150000 100000"`` is 1.5); None for ``"max ..."`` (no
    limit) or text that is not a quota."""
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    return _ratio(parts[0], parts[1])


def parse_cfs(quota: str, period: str) -> float | None:
    """CPUs of cgroup v1's ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us``; None for a quota of
    -1 (no limit) or text that is not a number."""
    return _ratio(quota.strip(), period.strip())


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def cgroup_cpus(root: Path = CGROUP) -> float | None:
    """The CPU quota of this process's cgroup (v2, else v1), or None where there is none."""
    try:
        return parse_cpu_max((root / "cpu.max").read_text())
    except OSError:
        pass
    try:
        return parse_cfs(
            (root / "cpu" / "cpu.cfs_quota_us").read_text(), (root / "cpu" / "cpu.cfs_period_us").read_text()
        )
    except OSError:
        return None


def pod_cpus(root: Path = CGROUP) -> int:
    """The CPUs this process may use: its affinity, less where the cgroup's quota is lower (a
    quota of 1.5 CPUs allows 2 processes to run, each part of the time); at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpus(root)
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def default_workers(cpus: int | None = None) -> int:
    """``spec.reward.workers`` unset: one process per CPU of the pod (``cpus``, else
    :func:`pod_cpus`), at least 1 and at most :data:`MAX_DEFAULT_WORKERS`."""
    return max(1, min(pod_cpus() if cpus is None else cpus, MAX_DEFAULT_WORKERS))
