"""Builders for the objects tests create most: a pod that runs a Python script, a PDB."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Obj = dict[str, Any]

# The container image is not pulled: the node agent runs the command with the local Python.
IMAGE = "spotrl-local:dev"


def python_pod(
    name: str,
    script: str,
    args: Sequence[str] = ("/data",),
    *,
    node: str | None = None,
    restart_policy: str = "Never",
    grace_seconds: int | None = None,
    labels: dict[str, str] | None = None,
    env: Sequence[Obj] = (),
    service_account: str | None = None,
    node_selector: dict[str, str] | None = None,
    resources: Obj | None = None,
    pre_stop: Sequence[str] | None = None,
    tolerations: Sequence[Obj] = (),
) -> Obj:
    """A pod whose one container runs ``python -c script *args`` with an emptyDir at ``/data``
    (``args`` defaults to ``/data``, so ``sys.argv[1]`` is the local folder of that volume)."""
    container: Obj = {
        "name": "main",
        "image": IMAGE,
        "command": ["python", "-c", script, *args],
        "env": list(env),
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        # Pod Security `restricted` (the e2e namespaces enforce it), as the operator's pods.
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    if resources:
        container["resources"] = resources
    if pre_stop:
        container["lifecycle"] = {"preStop": {"exec": {"command": list(pre_stop)}}}
    spec: Obj = {
        "restartPolicy": restart_policy,
        "containers": [container],
        "volumes": [{"name": "data", "emptyDir": {}}],
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "seccompProfile": {"type": "RuntimeDefault"}},
    }
    if grace_seconds is not None:
        spec["terminationGracePeriodSeconds"] = grace_seconds
    selector = dict(node_selector or {})
    if node:
        selector["kubernetes.io/hostname"] = node
    if selector:
        spec["nodeSelector"] = selector
    if service_account:
        spec["serviceAccountName"] = service_account
    if tolerations:
        spec["tolerations"] = list(tolerations)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {"app": name}},
        "spec": spec,
    }


def pdb(name: str, match_labels: dict[str, str], min_available: int = 1) -> Obj:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name},
        "spec": {"minAvailable": min_available, "selector": {"matchLabels": match_labels}},
    }


# A container that records SIGTERM in <data>/events, keeps cleaning up for CLEANUP seconds
# (argv[2], default 0; "forever" ignores SIGTERM), then exits 0.
SIGTERM_RECORDER = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1]) / "events"
cleanup = sys.argv[2] if len(sys.argv) > 2 else "0"
def note(what):
    with open(out, "a") as f:
        f.write(f"{what} {time.time():.3f}\\n")
def on_term(sig, frame):
    note("sigterm")
    if cleanup == "forever":
        return
    time.sleep(float(cleanup))
    note("done")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
note("started")
while True:
    time.sleep(0.2)
"""


def read_events(text: str) -> dict[str, float]:
    """Parses what :data:`SIGTERM_RECORDER` wrote: event -> time."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        what, when = line.split()
        out[what] = float(when)
    return out
