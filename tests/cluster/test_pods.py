"""Pods really run: command, environment, volumes, exit codes, restarts, scheduling by
extended resources, preStop hooks, and garbage collection of owned objects."""

import json
import os
import time
from typing import Any

import pytest

from spotrl_e2e.checks import pid_alive, wait_file
from spotrl_e2e.cluster import Cluster
from spotrl_e2e.kube import path
from spotrl_e2e.manifests import SIGTERM_RECORDER, python_pod, read_events

pytestmark = pytest.mark.cluster

ENV_DUMP = """
import json, os, pathlib, sys
keys = ["LITERAL", "EXPANDED", "POD_NAME", "POD_NAMESPACE", "POD_UID", "NODE_NAME", "POD_IP", "SA_NAME",
        "FROM_SECRET", "FROM_CONFIGMAP", "CM_colour", "KUBERNETES_SERVICE_HOST", "KUBECONFIG", "DATA_DIR"]
out = {k: os.environ.get(k) for k in keys}
out["argv"] = sys.argv[1:]
out["sa_files"] = sorted(p.name for p in pathlib.Path(sys.argv[2]).iterdir())
pathlib.Path(sys.argv[1], "env.json").write_text(json.dumps(out))
sys.exit(7)
"""


def test_command_runs_with_its_environment_and_exit_code(cluster: Cluster, namespace: str) -> None:
    admin = cluster.admin()
    admin.create(
        path("v1", "secrets", namespace),
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "creds"}, "stringData": {"token": "s3cr3t"}},
    )
    admin.create(
        path("v1", "configmaps", namespace),
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "settings"}, "data": {"colour": "teal"}},
    )
    env: list[dict[str, Any]] = [
        {"name": "LITERAL", "value": "plain"},
        {"name": "EXPANDED", "value": "$(LITERAL)-and-$(POD_NAME)"},  # POD_NAME defined later: kept as written
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "SA_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.serviceAccountName"}}},
        {"name": "FROM_SECRET", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
        {"name": "FROM_CONFIGMAP", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "colour"}}},
        {"name": "DATA_DIR", "value": "/data/sub"},
    ]
    pod = python_pod(
        "env-dump", ENV_DUMP, args=("/data", "/var/run/secrets/kubernetes.io/serviceaccount"), node="spot-b", env=env
    )
    pod["spec"]["containers"][0]["envFrom"] = [{"prefix": "CM_", "configMapRef": {"name": "settings"}}]
    admin.create(path("v1", "pods", namespace), pod)

    done = cluster.wait_pod(namespace, "env-dump", "Failed", timeout=30)
    assert done is not None
    status = done["status"]
    (container,) = status["containerStatuses"]
    assert container["state"]["terminated"]["exitCode"] == 7
    assert container["state"]["terminated"]["reason"] == "Error"
    assert status["podIP"].startswith("127.0.")
    assert status["hostIP"] != status["podIP"]

    seen = json.loads((cluster.pod_dir(namespace, "env-dump") / "volumes" / "data" / "env.json").read_text())
    assert seen["LITERAL"] == "plain"
    assert seen["EXPANDED"] == "plain-and-$(POD_NAME)"
    assert seen["POD_NAME"] == "env-dump"
    assert seen["POD_NAMESPACE"] == namespace
    assert seen["POD_UID"] == done["metadata"]["uid"]
    assert seen["NODE_NAME"] == "spot-b"
    assert seen["POD_IP"] == status["podIP"]
    assert seen["SA_NAME"] == "default"
    assert seen["FROM_SECRET"] == "s3cr3t"
    assert seen["FROM_CONFIGMAP"] == "teal"
    assert seen["CM_colour"] == "teal"
    assert seen["KUBERNETES_SERVICE_HOST"] == "127.0.0.1"
    assert seen["KUBECONFIG"]
    assert os.path.exists(seen["KUBECONFIG"])
    # Mount paths in args and env point at the pod's volume folders on the node.
    data_dir = str(cluster.pod_dir(namespace, "env-dump") / "volumes" / "data")
    assert seen["argv"][0] == data_dir
    assert seen["DATA_DIR"] == data_dir + "/sub"
    # The ServiceAccount admission plugin's projected volume: a bound token, the CA, the namespace.
    assert seen["sa_files"] == ["ca.crt", "namespace", "token"]


def test_restart_policy_on_failure_restarts_the_container(cluster: Cluster, namespace: str) -> None:
    script = """
import pathlib, sys
marker = pathlib.Path(sys.argv[1], "tried")
if not marker.exists():
    marker.write_text("once")
    sys.exit(3)
print("second run succeeds")
"""
    cluster.admin().create(path("v1", "pods", namespace), python_pod("flaky", script, restart_policy="OnFailure"))
    done = cluster.wait_pod(namespace, "flaky", "Succeeded", timeout=30)
    assert done is not None
    (container,) = done["status"]["containerStatuses"]
    assert container["restartCount"] == 1
    assert container["lastState"]["terminated"]["exitCode"] == 3
    assert container["state"]["terminated"]["exitCode"] == 0
    assert "second run succeeds" in cluster.kubectl("logs", "-n", namespace, "flaky").stdout


def test_gpu_requests_are_scheduled_by_capacity(cluster: Cluster, namespace: str) -> None:
    """Each node advertises one nvidia.com/gpu: the second on-demand GPU pod cannot be placed."""
    gpu = {"limits": {"nvidia.com/gpu": "1"}}
    on_demand = {"karpenter.sh/capacity-type": "on-demand"}
    sleeper = "import time\nwhile True: time.sleep(1)"
    for name in ("gpu-1", "gpu-2"):
        pod = python_pod(name, sleeper, node_selector=on_demand, resources=gpu, grace_seconds=1)
        cluster.admin().create(path("v1", "pods", namespace), pod)
    first = cluster.wait_pod(namespace, "gpu-1", "Running", timeout=30)
    assert first is not None
    assert first["spec"]["nodeName"] == "ondemand-a"

    def unschedulable(p: dict | None) -> bool:
        conds = (p or {}).get("status", {}).get("conditions", [])
        return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conds)

    second = cluster.wait_pod(namespace, "gpu-2", unschedulable, timeout=30)
    assert second is not None
    assert "nvidia.com/gpu" in next(c["message"] for c in second["status"]["conditions"] if c["type"] == "PodScheduled")


def test_deletion_runs_pre_stop_then_sigterm_within_the_grace_period(cluster: Cluster, namespace: str) -> None:
    pre_stop = [
        "python",
        "-c",
        "import sys, time; open(sys.argv[1] + '/events', 'a').write(f'prestop {time.time():.3f}\\n')",
        "/data",
    ]
    pod = python_pod("graceful", SIGTERM_RECORDER, args=("/data", "2"), grace_seconds=20, pre_stop=pre_stop)
    cluster.admin().create(path("v1", "pods", namespace), pod)
    cluster.wait_pod(namespace, "graceful", "Running", timeout=30)
    events_file = cluster.pod_dir(namespace, "graceful") / "volumes" / "data" / "events"
    wait_file(events_file, "started")

    t0 = time.time()
    cluster.admin().delete(path("v1", "pods", namespace, "graceful"))
    cluster.wait_pod(namespace, "graceful", lambda p: p is None, timeout=30)
    events = read_events(events_file.read_text())
    assert events["prestop"] <= events["sigterm"] <= events["done"]
    # It got the time it asked for (2 s of cleanup) and was not killed early.
    assert events["done"] - events["sigterm"] >= 1.9
    assert events["sigterm"] >= t0 - 1


def test_cascade_deletion_removes_children(cluster: Cluster, namespace: str) -> None:
    """Deployment -> ReplicaSet -> Pods: deleting the Deployment lets the garbage collector
    remove the rest, and the node stops the processes."""
    template = python_pod("web", "import time\nwhile True: time.sleep(1)", grace_seconds=1, restart_policy="Always")
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {"metadata": {"labels": {"app": "web"}}, "spec": template["spec"]},
        },
    }
    admin = cluster.admin()
    admin.create(path("apps/v1", "deployments", namespace), deployment)

    def running_pods() -> list[dict]:
        pods = admin.get(path("v1", "pods", namespace), labelSelector="app=web")["items"]
        return [p for p in pods if p.get("status", {}).get("phase") == "Running"]

    deadline = time.monotonic() + 40
    while len(running_pods()) < 2:
        assert time.monotonic() < deadline, f"deployment web never had 2 running pods: {running_pods()}"
        time.sleep(0.3)
    pods = running_pods()
    assert all(p["metadata"]["ownerReferences"][0]["kind"] == "ReplicaSet" for p in pods)
    pids = [pid for p in pods for pid in cluster.pod_pids(namespace, p["metadata"]["name"]).values()]
    assert len(pids) == 2
    assert all(pid_alive(pid) for pid in pids)

    admin.delete(path("apps/v1", "deployments", namespace, "web"), {"propagationPolicy": "Background"})
    deadline = time.monotonic() + 40
    while (
        admin.get(path("v1", "pods", namespace))["items"]
        or admin.get(path("apps/v1", "replicasets", namespace))["items"]
    ):
        assert time.monotonic() < deadline, "the garbage collector did not remove the ReplicaSet and its pods"
        time.sleep(0.3)
    assert not any(pid_alive(pid) for pid in pids)


def test_init_container_runs_first_and_crash_loops_back_off(cluster: Cluster, namespace: str) -> None:
    """Init containers run to completion before the main one; a main container that keeps
    failing under restartPolicy Always is restarted with a back-off (CrashLoopBackOff)."""
    pod = python_pod(
        "init-then-crash",
        "import pathlib, sys; print(pathlib.Path(sys.argv[1], 'prepared').read_text()); sys.exit(1)",
        restart_policy="Always",
        grace_seconds=1,
    )
    pod["spec"]["initContainers"] = [
        {
            "name": "prepare",
            "image": "spotrl-local:dev",
            "command": ["python", "-c", "import sys; open(sys.argv[1] + '/prepared', 'w').write('ready')", "/data"],
            "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        }
    ]
    cluster.admin().create(path("v1", "pods", namespace), pod)

    def crash_looping(p: dict[str, Any] | None) -> bool:
        statuses = (p or {}).get("status", {}).get("containerStatuses") or [{}]
        return statuses[0].get("restartCount", 0) >= 2

    looping = cluster.wait_pod(namespace, "init-then-crash", crash_looping, timeout=40)
    assert looping is not None
    status = looping["status"]
    assert status["phase"] == "Running"
    (init,) = status["initContainerStatuses"]
    assert init["state"]["terminated"]["exitCode"] == 0
    (main,) = status["containerStatuses"]
    assert main["lastState"]["terminated"]["exitCode"] == 1
    # The newest run's log may be a restart that has not printed yet: wait for the line, as a
    # person reading `kubectl logs` during a crash loop would (not `assert` at one instant).
    deadline = time.monotonic() + 30
    while "ready" not in cluster.pod_log(namespace, "init-then-crash", "main"):
        assert time.monotonic() < deadline, "the main container never printed what the init container wrote"
        time.sleep(0.2)
