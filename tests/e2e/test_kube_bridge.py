"""The controller's Kubernetes bridge in a pod, with the job's runtime ServiceAccount and its
Role (as the operator makes them), against the real API server: barrier requests answered
with test-guarded JSON patches, stale answers refused, other attempts ignored, status writes
(and the Ray head of worker pods) guarded by the attempt. No operator runs here: the test writes the requests itself."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from operator_harness import RLJOBS, apply_crd, tiny_job, wait_until

from spotrl_e2e.cluster import Cluster
from spotrl_e2e.kube import path
from spotrl_e2e.manifests import python_pod
from spotrl_operator import resources
from spotrl_operator.settings import Settings

pytestmark = pytest.mark.cluster

# The test reads a file the moment it appears: each is written whole, then renamed into place.
PUT = """
import os, pathlib, sys
out = pathlib.Path(sys.argv[1])
def put(name, text):
    (out / (name + ".part")).write_text(text)
    os.replace(out / (name + ".part"), out / name)
"""

# The controller side: the real KubeBridge, with a Controllable whose cuts commit when the
# test creates go-<n> in the pod's data folder.
CONTROLLER = (
    PUT
    + """
import logging, pathlib, sys, time, types
logging.basicConfig(level=logging.INFO)  # the bridge's notes: what it ignored, what did not land
from spotrl_runtime.controller.control import BarrierFailed, CutInfo
from spotrl_runtime.controller.kube_bridge import KubeBridge
class Cuts:
    n = 0
    def request_barrier(self, reason, deadline):
        Cuts.n += 1
        n = Cuts.n
        put(f"asked-{n}", f"{reason} {deadline.unix():.0f}")
        if reason == "fail":
            raise BarrierFailed("storage unreachable")
        while not (out / f"go-{n}").exists():
            time.sleep(0.05)
        return CutInfo(f"{n:010d}", 10 + n, f"s3://bucket-x/j/cuts/{n:010d}", "barrier", time.time(), 0.1)
bridge = KubeBridge.from_env()
assert bridge.publish_ray_head("127.0.1.9:4321", 2)  # before start: the controller waits for workers
bridge.start(Cuts())
damaged = types.SimpleNamespace(cut_id="0000000009", check="file_digest", message="weights.pt: sha256 differs")
bridge.on_started(CutInfo("0000000008", 2, "s3://bucket-x/j/cuts/0000000008", "periodic", time.time(), 0.0), [damaged])
now = time.time()
bridge.note_start(
    types.SimpleNamespace(
        started_at=now - 3, restored_at=now - 2, ready_at=now - 1, cut_form="delta", steps_redone=2
    )
)
for step in (1, 2, 3):
    bridge.on_step(step, {})
bridge.on_cut(CutInfo("0000000000", 3, "s3://bucket-x/j/cuts/0000000000", "periodic", time.time(), 0.1))
assert bridge.flush(10)
put("ready", "1")
while not (out / "stop").exists():
    time.sleep(0.1)
put("late-head", str(bridge.publish_ray_head("127.0.1.9:9999", 2)))
bridge.on_finished(20)
bridge.stop()
print("bridge stopped", flush=True)
"""
)


def rfc3339(dt: datetime) -> str:
    return dt.strftime("%Y-%m-%dT%H:%M:%SZ")


def job_with_runtime_identity(cluster: Cluster, namespace: str) -> tuple[str, str]:
    """RLJob ``j`` at attempt 1, Running, with the runtime's ServiceAccount, Role and RoleBinding
    as the operator makes them (no operator runs). Returns (the RLJobs' URL, j's status URL)."""
    apply_crd(cluster)
    admin = cluster.admin()
    jobs_url = path(RLJOBS, "rljobs", namespace)
    job = admin.create(jobs_url, tiny_job("j", checkpoint={"storage": "s3://bucket-x/j"}))
    ref = resources.JobRef("j", namespace, job["metadata"]["uid"])
    for obj, plural, version in (
        (resources.service_account(ref, Settings()), "serviceaccounts", "v1"),
        (resources.role(ref), "roles", "rbac.authorization.k8s.io/v1"),
        (resources.role_binding(ref), "rolebindings", "rbac.authorization.k8s.io/v1"),
    ):
        admin.create(path(version, plural, namespace), obj)
    status_url = f"{jobs_url}/j/status"
    admin.patch(status_url, {"status": {"attempt": 1, "phase": "Running"}})
    return jobs_url, status_url


def test_the_bridge_answers_barriers_and_reports_status_with_its_runtime_identity(
    cluster: Cluster, namespace: str
) -> None:
    admin = cluster.admin()
    jobs_url, status_url = job_with_runtime_identity(cluster, namespace)

    env = [
        {"name": "SPOTRL_JOB", "value": "j"},
        {"name": "SPOTRL_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "SPOTRL_ATTEMPT", "value": "1"},
    ]
    pod = python_pod("controller", CONTROLLER, service_account="j-runtime", env=env, node="spot-a")
    admin.create(path("v1", "pods", namespace), pod)
    cluster.wait_pod(namespace, "controller", "Running", timeout=30)
    data = cluster.pod_dir(namespace, "controller") / "volumes" / "data"

    def status() -> dict:
        return dict(admin.get(f"{jobs_url}/j").get("status") or {})

    def request(request_id: str, reason: str, attempt: int = 1) -> datetime:
        now = datetime.now(UTC)
        barrier = {
            "requestId": request_id,
            "reason": reason,
            "attempt": attempt,
            "state": "Requested",
            "requestedAt": rfc3339(now),
            "deadline": rfc3339(now + timedelta(seconds=60)),
            # A new request replaces the old one whole, as the operator's write does.
            "cutId": None,
            "committedAt": None,
            "message": None,
        }
        admin.patch(status_url, {"status": {"barrier": barrier}})
        return now + timedelta(seconds=60)

    def wait_status(check: object, what: str, timeout: float = 15) -> dict:
        admin.wait_for(f"{jobs_url}/j", lambda o: check((o or {}).get("status") or {}), timeout, what)  # type: ignore[operator]
        return status()

    def asked(n: int) -> Path:
        return data / f"asked-{n}"

    def log() -> str:
        return cluster.pod_log(namespace, "controller")

    try:
        try:
            # The pod's Python imports the runtime's API model first: seconds, more beside a loaded lane.
            wait_until(lambda: (data / "ready").exists(), 90, "the bridge to start")
        except TimeoutError as err:
            raise AssertionError(f"{err}; its log:\n{cluster.pod_log(namespace, 'controller')}") from None
        st = status()
        assert (st["step"], st["stepAttempt"]) == (3, 1)
        assert (st["lastCut"]["id"], st["lastCut"]["kind"]) == ("0000000000", "periodic")
        assert st["rayHead"] == {"address": "127.0.1.9:4321", "attempt": 1, "workers": 2, "trainers": 0}
        skipped = [{"id": "0000000009", "check": "file_digest", "message": "weights.pt: sha256 differs"}]
        assert st["resume"] == {"attempt": 1, "cutId": "0000000008", "skipped": skipped}
        # The controller's start, phase by phase, and its first step (written with step 1).
        at = st["attemptTimes"]
        assert at["attempt"] == 1, at
        marks = [at[k] for k in ("startedAt", "restoredAt", "readyAt", "firstStepAt")]
        assert marks == sorted(marks), at
        assert (at["cutForm"], at["stepsRedone"]) == ("delta", 2), at

        # 1. A request is answered: the cut commits, then Committed + cutId + lastCut.
        deadline = request("r1", "cordon: spec.unschedulable")
        wait_until(asked(1).exists, 10, "the bridge to ask for a cut")
        reason, _, when = asked(1).read_text().rpartition(" ")
        assert reason == "cordon: spec.unschedulable"
        # status.barrier.deadline (whole seconds) reached the controller as the same instant.
        assert abs(float(when) - deadline.timestamp()) <= 2, (when, deadline)
        assert status()["barrier"]["state"] == "Requested", "no answer before the cut commits"
        (data / "go-1").touch()
        st = wait_status(lambda s: s["barrier"]["state"] == "Committed", "r1 committed")
        assert st["barrier"]["requestId"] == "r1"
        assert st["barrier"]["cutId"] == "0000000001"
        assert st["barrier"]["committedAt"]
        assert (st["lastCut"]["id"], st["lastCut"]["step"], st["lastCut"]["kind"]) == ("0000000001", 11, "barrier")

        # 2. A stale answer does not land: r2 is replaced by r3 while its cut is being taken.
        request("r2", "taint: karpenter.sh/disrupted")
        wait_until(asked(2).exists, 10, "the cut for r2")
        request("r3", "taint: karpenter.sh/disrupted again")
        wait_until(asked(3).exists, 10, "the cut for r3")
        (data / "go-2").touch()
        wait_until(
            lambda: "answer to barrier r2 not written: the RLJob's status moved on" in log(),
            15,
            "r2's answer to be refused",
        )
        st = status()
        assert (st["barrier"]["requestId"], st["barrier"]["state"]) == ("r3", "Requested")
        assert "cutId" not in st["barrier"], "r2's answer landed on r3"
        (data / "go-3").touch()
        st = wait_status(lambda s: s["barrier"]["state"] == "Committed", "r3 committed")
        assert (st["barrier"]["requestId"], st["barrier"]["cutId"]) == ("r3", "0000000003")

        # 3. A cut that cannot commit is answered Failed, with the reason.
        request("r4", "fail")
        st = wait_status(lambda s: s["barrier"]["state"] == "Failed", "r4 failed")
        assert st["barrier"]["message"] == "storage unreachable"

        # 4. A request for another attempt is not this controller's.
        request("r5", "cordon", attempt=2)
        wait_until(lambda: "barrier r5 is for attempt 2, not for this controller (1): ignored" in log(), 15, "r5 seen")
        assert not asked(5).exists()
        assert status()["barrier"]["state"] == "Requested"

        # 5. Once a newer controller owns the status, this one's writes fail their test.
        admin.patch(status_url, {"status": {"attempt": 2}})
        (data / "stop").touch()
        cluster.wait_pod(namespace, "controller", "Succeeded", timeout=40)
        st = status()
        assert st["step"] == 3, "a replaced controller wrote its final step over its successor's status"
        assert (data / "late-head").read_text() == "False"
        assert st["rayHead"]["address"] == "127.0.1.9:4321", "a replaced controller published its head"
        assert "not written: the RLJob's status moved on" in cluster.pod_log(namespace, "controller")
    finally:
        (data / "stop").touch()
        for n in range(1, 6):
            (data / f"go-{n}").touch()
        admin.delete(f"{jobs_url}/j")


# A standby's wait, as `spotrl controller` runs it (spotrl_runtime.controller.standby), with a
# stand-in for the prestarted Ray (none is started here).
STANDBY = (
    PUT
    + """
import json, logging, pathlib, sys, time
logging.basicConfig(level=logging.INFO)
from spotrl_runtime.api.rljob import parse_rljob
from spotrl_runtime.controller.assemble import ControllerOptions
from spotrl_runtime.controller.kube_bridge import KubeBridge
from spotrl_runtime.controller.standby import StandbyStopped, stand_by
class Prestart:
    def wait(self, workers=False):
        put("prestart-waited", str(workers))
bridge = KubeBridge.from_env()
options = ControllerOptions(storage_uri="s3://bucket-x/j")
try:
    rljob = stand_by(parse_rljob(bridge.read_job()), bridge, options, Prestart())
except StandbyStopped:
    put("stopped", str(time.time()))
    time.sleep(5)
    sys.exit(143)
policy = [c.__name__ for c in type(options.policy[0]).__mro__]
got = {"attempt": rljob["status"]["attempt"], "started_at": options.started_at, "policy": policy}
put("promoted", json.dumps(got))
"""
)


def test_a_standby_warms_up_claims_nothing_and_goes_on_when_its_attempt_comes(cluster: Cluster, namespace: str) -> None:
    admin = cluster.admin()
    jobs_url, status_url = job_with_runtime_identity(cluster, namespace)

    def standby(name: str, attempt: int) -> Path:
        env = [
            {"name": "SPOTRL_JOB", "value": "j"},
            {"name": "SPOTRL_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "SPOTRL_ATTEMPT", "value": str(attempt)},
        ]
        pod = python_pod(name, STANDBY, service_account="j-runtime", env=env, node="spot-b", grace_seconds=30)
        admin.create(path("v1", "pods", namespace), pod)
        cluster.wait_pod(namespace, name, "Running", timeout=30)
        wait_until(
            lambda: f"waiting for status.attempt to reach {attempt}" in cluster.pod_log(namespace, name),
            120,
            f"{name} to be warm; log:\n{cluster.pod_log(namespace, name)}",
        )
        return cluster.pod_dir(namespace, name) / "volumes" / "data"

    try:
        data = standby("standby-2", 2)
        assert (data / "prestart-waited").read_text() == "True", "it waits for its generation workers too"
        seen = admin.get(f"{jobs_url}/j")["metadata"]["resourceVersion"]
        time.sleep(2)
        assert not (data / "promoted").exists(), "it went on before its attempt came"
        assert admin.get(f"{jobs_url}/j")["metadata"]["resourceVersion"] == seen, "a standby wrote to the RLJob"

        # Another attempt's change is not its own: it goes on waiting.
        admin.patch(status_url, {"status": {"phase": "Checkpointing"}})
        time.sleep(1)
        assert not (data / "promoted").exists()
        came = time.time()
        admin.patch(status_url, {"status": {"attempt": 2}})
        wait_until((data / "promoted").exists, 10, "the standby to see its attempt")
        got = json.loads((data / "promoted").read_text())
        assert got["attempt"] == 2
        assert "PreTrainedModel" in got["policy"], "the policy was loaded while it waited"
        assert came - 1 <= got["started_at"] <= time.time(), "its start counts from its attempt, not its process"

        # A SIGTERM while waiting ends it at once, not at the end of the watch or the grace period.
        data = standby("standby-3", 3)
        deleted = time.time()
        admin.delete(path("v1", "pods", namespace, "standby-3"))
        wait_until((data / "stopped").exists, 10, "the standby to stop on SIGTERM")
        assert float((data / "stopped").read_text()) - deleted < 5
    finally:
        admin.delete(f"{jobs_url}/j")
