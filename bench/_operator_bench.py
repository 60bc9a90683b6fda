"""What the operator benchmarks share: percentiles and the idle pod that stands in for a controller."""

from __future__ import annotations

from typing import Any

Obj = dict[str, Any]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def idle_pod(job: str, node: str) -> Obj:
    """A pod with the job's controller name and labels, bound to ``node``: the operator adopts it
    as attempt 1's controller."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{job}-controller-1",
            "labels": {"spotrl.dev/job": job, "spotrl.dev/role": "controller", "spotrl.dev/attempt": "1"},
        },
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "controller", "image": "idle", "command": ["sleep", "86400"]}],
        },
    }
