"""A refused action backs off (failureBudget's doubling wait, capped), does not hold the other
actions back, and is reported on the job: the ReconcileError condition and one Event per
failed try, both gone once it succeeds. A narrow fake API server stands in here; the real
one refuses a real pod in tests/e2e/test_operator.py."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

from spotrl_operator import resources
from spotrl_operator.actuate import STUCK, Actuator, action_key
from spotrl_operator.observe import Snapshot
from spotrl_operator.resources import JobRef
from spotrl_operator.settings import Settings
from spotrl_operator.world import CloseDisruptionBudget, CreateControllerPod, CreateTrainerPod, DeletePod, Plan
from spotrl_runtime.kube import JSON_PATCH, KubeError

Obj = dict[str, Any]
T0 = datetime(2026, 1, 1, tzinfo=UTC)
REF = JobRef("tiny", "ns", "u1")


class FakeKube:
    """Pods refused with ``refuse`` while it is set; statuses patched in place; Events kept."""

    def __init__(self, job: Obj):
        self.job = job
        self.refuse: KubeError | None = None
        self.calls: list[tuple[str, str]] = []
        self.events: dict[str, Obj] = {}

    def create(self, url: str, obj: Obj) -> Obj:
        self.calls.append(("POST", url))
        if url.endswith("/pods") and self.refuse is not None:
            raise self.refuse
        if url.endswith("/events"):
            if obj["metadata"]["name"] in self.events:
                raise KubeError("POST", url, 409, "AlreadyExists", "")
            self.events[obj["metadata"]["name"]] = obj
        return obj

    def create_or_get(self, url: str, obj: Obj) -> tuple[Obj, bool]:
        return obj, False

    def get(self, url: str, **_: Any) -> Obj:
        return self.events[url.rsplit("/", 1)[-1]]

    def patch(self, url: str, body: Obj, content_type: str = "") -> Obj:
        self.calls.append(("PATCH", url))
        if url.endswith("/status"):
            self.job["status"].update(body["status"])
            rv = int(self.job["metadata"]["resourceVersion"]) + 1
            self.job["metadata"]["resourceVersion"] = str(rv)
            return copy.deepcopy(self.job)
        if "/events/" in url:
            self.events[url.rsplit("/", 1)[-1]].update(body)
        return {}


def job() -> Obj:
    return {
        "apiVersion": "spotrl.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "tiny", "namespace": "ns", "uid": "u1", "resourceVersion": "1", "generation": 1},
        "spec": {
            "policy": {"model": "builtin:tiny-arith"},
            "dataset": {"uri": "builtin:arithmetic"},
            "reward": {"name": "arithmetic_exact"},
            "training": {"totalSteps": 10},
            "checkpoint": {"storage": "s3://bucket/tiny"},
            "failureBudget": {"backoffSeconds": 10, "maxBackoffSeconds": 30},
        },
        "status": {"phase": "Rescheduling", "attempt": 3},
    }


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


def condition(kube: FakeKube) -> Obj | None:
    return next((c for c in kube.job["status"].get("conditions") or [] if c["type"] == STUCK), None)


def pod_posts(kube: FakeKube) -> int:
    return sum(1 for m, u in kube.calls if m == "POST" and u.endswith("/pods"))


def test_a_refused_pod_backs_off_doubling_to_the_cap_and_is_reported_until_it_succeeds() -> None:
    kube = FakeKube(job())
    clock = Clock()
    actuator = Actuator(kube, Settings(), clock=clock)  # type: ignore[arg-type]
    kube.refuse = KubeError("POST", "/api/v1/namespaces/ns/pods", 422, "Invalid", "must be only one value")
    plan = Plan(actions=[CreateControllerPod(3, frozenset()), CloseDisruptionBudget()])

    tried_at = []
    for second in range(0, 200):
        clock.now = T0 + timedelta(seconds=second)
        before = pod_posts(kube)
        applied = actuator.apply(Snapshot(job=copy.deepcopy(kube.job)), plan)
        if pod_posts(kube) > before:
            tried_at.append(second)
            assert [f.tries for f in applied.failed] == [len(tried_at)]
        else:
            assert applied.held == [plan.actions[0]]
        assert CloseDisruptionBudget() in applied.done, "a refused pod does not hold the PDB back"
    # 10 s, 20 s, then the 30 s cap.
    assert tried_at == [0, 10, 30, 60, 90, 120, 150, 180]

    cond = condition(kube)
    assert cond is not None
    assert cond["status"] == "True"
    assert cond["reason"] == "Invalid"
    assert (
        "creating pod tiny-controller-3 failed 8 time(s): HTTP 422 Invalid: must be only one value" in cond["message"]
    )
    assert "cannot succeed until something changes" in cond["message"]
    (event,) = [e for e in kube.events.values() if e["reason"] == "ReconcileFailed"]
    assert event["count"] == len(tried_at), "one Event, counted once per failed try"
    assert event["type"] == "Warning"

    # Whatever was wrong is fixed: the next try succeeds and the condition goes.
    kube.refuse = None
    clock.now = T0 + timedelta(seconds=400)
    applied = actuator.apply(Snapshot(job=copy.deepcopy(kube.job)), plan)
    assert applied.failed == []
    assert applied.held == []
    assert condition(kube) is None
    assert any(e["reason"] == "Reconciled" for e in kube.events.values())
    status_writes = sum(1 for m, u in kube.calls if m == "PATCH" and u.endswith("/status"))
    actuator.apply(Snapshot(job=copy.deepcopy(kube.job)), plan)
    assert sum(1 for m, u in kube.calls if m == "PATCH" and u.endswith("/status")) == status_writes, (
        "a quiet pass writes nothing"
    )


def test_a_server_error_is_marked_as_one_that_may_pass_and_each_action_has_its_own_backoff() -> None:
    kube = FakeKube(job())
    clock = Clock()
    actuator = Actuator(kube, Settings(), clock=clock)  # type: ignore[arg-type]
    kube.refuse = KubeError("POST", "/pods", 503, "ServiceUnavailable", "etcd is slow")
    actuator.apply(Snapshot(job=copy.deepcopy(kube.job)), Plan(actions=[CreateControllerPod(3, frozenset())]))
    cond = condition(kube)
    assert cond is not None
    assert cond["reason"] == "ServiceUnavailable"
    assert "may be passing" in cond["message"]
    # Another pod (another key) is not held by the first one's backoff.
    applied = actuator.apply(Snapshot(job=copy.deepcopy(kube.job)), Plan(actions=[CreateControllerPod(4, frozenset())]))
    assert len(applied.failed) == 1
    assert applied.held == []
    assert action_key("tiny", CreateControllerPod(4, frozenset()))[1] == "creating pod tiny-controller-4"


class RecordingKube(FakeKube):
    """Also keeps what was sent."""

    def __init__(self, job: Obj):
        super().__init__(job)
        self.sent: list[tuple[str, Any, str]] = []

    def create(self, url: str, obj: Obj) -> Obj:
        self.sent.append((url, obj, ""))
        return super().create(url, obj)

    def patch(self, url: str, body: Any, content_type: str = "") -> Obj:
        self.sent.append((url, body, content_type))
        return super().patch(url, body, content_type)


def test_the_budget_is_set_whole_and_a_trainer_pod_is_created_as_one() -> None:
    """Closing the PDB replaces its selector (a merge patch would keep the old role label and
    hold the controller only); a CreateTrainerPod makes the trainer pod."""
    doc = job()
    doc["spec"]["training"]["parallelism"] = {"strategy": "fsdp", "ranks": 2, "trainerPods": True}
    kube = RecordingKube(doc)
    actuator = Actuator(kube, Settings(), clock=Clock())  # type: ignore[arg-type]
    plan = Plan(actions=[CloseDisruptionBudget(), CreateTrainerPod(3, 1, "127.0.1.2:40001", frozenset())])
    applied = actuator.apply(Snapshot(job=copy.deepcopy(kube.job)), plan)
    assert applied.failed == []
    ((url, ops, content_type),) = [s for s in kube.sent if "poddisruptionbudgets" in s[0]]
    assert url.endswith("/poddisruptionbudgets/tiny-controller")
    assert content_type == JSON_PATCH
    assert ops == [
        {"op": "add", "path": "/spec/minAvailable", "value": 3},
        {
            "op": "add",
            "path": "/spec/selector",
            "value": {
                "matchLabels": {"spotrl.dev/job": "tiny"},
                "matchExpressions": [
                    {"key": "spotrl.dev/role", "operator": "In", "values": ["controller", "trainer"]},
                    {"key": "spotrl.dev/standby", "operator": "DoesNotExist"},
                ],
            },
        },
    ]
    ((_, pod, _),) = [s for s in kube.sent if s[0].endswith("/pods")]
    assert pod["metadata"]["name"] == "tiny-trainer-3-1"
    assert pod["spec"]["containers"][0]["args"][:4] == ["--role", "trainer", "--address", "127.0.1.2:40001"]
    assert action_key("tiny", plan.actions[1]) == ("create-pod/tiny-trainer-3-1", "creating pod tiny-trainer-3-1")


def test_the_budget_is_patched_only_if_still_as_the_pass_saw_it() -> None:
    """A pass on a stale view (the budget changed since) sends a patch the server refuses, and
    nothing fails: the change's own watch event brings the next pass."""
    kube = RecordingKube(job())
    actuator = Actuator(kube, Settings(), clock=Clock())  # type: ignore[arg-type]
    seen = {"metadata": {"owner": None}, "spec": {"minAvailable": 0, "selector": None}}
    applied = actuator.apply(Snapshot(job=copy.deepcopy(kube.job), pdb=seen), Plan(actions=[CloseDisruptionBudget()]))
    assert applied.failed == []
    ((_, ops, _),) = [s for s in kube.sent if "poddisruptionbudgets" in s[0]]
    assert ops[0] == {"op": "test", "path": "/spec/minAvailable", "value": 0}

    class Moved(RecordingKube):
        def patch(self, url: str, body: Any, content_type: str = "") -> Obj:
            if "poddisruptionbudgets" in url:
                raise KubeError("PATCH", url, 422, "Invalid", "the test operation failed")
            return super().patch(url, body, content_type)

    moved = Moved(job())
    actuator = Actuator(moved, Settings(), clock=Clock())  # type: ignore[arg-type]
    applied = actuator.apply(Snapshot(job=copy.deepcopy(moved.job), pdb=seen), Plan(actions=[CloseDisruptionBudget()]))
    assert applied.failed == []
    assert condition(moved) is None, "a stale view is no failure to report"


def test_an_object_of_another_job_uid_is_never_adopted() -> None:
    """A deleted job's Service (same name, its uid) still there: the new job refuses it, and says so."""
    doc = job()

    class Leftover(RecordingKube):
        def create_or_get(self, url: str, obj: Obj) -> tuple[Obj, bool]:
            if url.endswith("/services"):
                old = copy.deepcopy(obj)
                old["metadata"]["ownerReferences"][0]["uid"] = "old-uid"
                return old, False
            return obj, False

    kube = Leftover(doc)
    actuator = Actuator(kube, Settings(), clock=Clock())  # type: ignore[arg-type]
    applied = actuator.apply(Snapshot(job=copy.deepcopy(kube.job)), Plan(actions=[CreateControllerPod(1, frozenset())]))
    (failure,) = applied.failed
    assert (failure.error.status, failure.error.reason) == (409, "OwnedByAnotherJob")
    assert "old-uid" in failure.error.message
    assert not failure.permanent, "it passes once the garbage collector deletes the old one"
    assert pod_posts(kube) == 0, "no pod before the job's objects are its own"
    cond = condition(kube)
    assert cond is not None
    assert cond["reason"] == "OwnedByAnotherJob"


class Accounts(RecordingKube):
    """The job's ServiceAccount as ``account`` (None: there is none); deletes and GETs recorded."""

    def __init__(self, job: Obj, account: Obj | None):
        super().__init__(job)
        self.account = account
        self.deleted: list[tuple[str, str | None]] = []

    def create_or_get(self, url: str, obj: Obj) -> tuple[Obj, bool]:
        self.sent.append((url, obj, ""))
        if url.endswith("/serviceaccounts") and self.account is not None:
            return copy.deepcopy(self.account), False
        return obj, False

    def get(self, url: str, **params: Any) -> Obj:
        if url.endswith("/pods"):
            return {"items": []}
        return super().get(url, **params)

    def get_or_none(self, url: str) -> Obj | None:
        return copy.deepcopy(self.account) if "/serviceaccounts/" in url else None

    def delete(self, url: str, grace_seconds: int | None = None, uid: str | None = None) -> bool:
        self.deleted.append((url, uid))
        return True


def someones_account() -> Obj:
    return {"metadata": {"name": "tiny-runtime", "namespace": "ns", "uid": "theirs", "resourceVersion": "7"}}


def test_an_account_spotrl_did_not_make_is_never_used() -> None:
    """Someone's ``tiny-runtime`` account (no RLJob owns it): no pod runs as it, and the job
    says which account and what to do; the account SpotRL keeps for a deletion pod is its own."""
    kube = Accounts(job(), someones_account())
    actuator = Actuator(kube, Settings(), clock=Clock())  # type: ignore[arg-type]
    applied = actuator.apply(Snapshot(job=copy.deepcopy(kube.job)), Plan(actions=[CreateControllerPod(3, frozenset())]))
    (failure,) = applied.failed
    assert (failure.error.status, failure.error.reason) == (409, "NotMadeBySpotRL")
    assert "ServiceAccount tiny-runtime already exists and SpotRL did not make it" in failure.error.message
    assert "create the job under another name, or delete or rename the ServiceAccount" in failure.error.message
    assert pod_posts(kube) == 0, "no pod runs as it"
    cond = condition(kube)
    assert cond is not None
    assert cond["reason"] == "NotMadeBySpotRL"
    (event,) = [e for e in kube.events.values() if e["reason"] == "ReconcileFailed"]
    assert "ServiceAccount tiny-runtime" in event["message"]

    kept = Accounts(job(), resources.retention_service_account(REF, Settings()))
    actuator = Actuator(kept, Settings(), clock=Clock())  # type: ignore[arg-type]
    applied = actuator.apply(Snapshot(job=copy.deepcopy(kept.job)), Plan(actions=[CreateControllerPod(3, frozenset())]))
    assert applied.failed == []
    assert pod_posts(kept) == 1


def test_a_delete_carries_the_uid_the_pass_saw() -> None:
    kube = Accounts(job(), None)
    actuator = Actuator(kube, Settings(), clock=Clock())  # type: ignore[arg-type]
    pod = {"metadata": {"name": "tiny-controller-2", "uid": "pod-uid"}}
    snap = Snapshot(job=copy.deepcopy(kube.job), pods=(pod,))
    applied = actuator.apply(snap, Plan(actions=[DeletePod("tiny-controller-2")]))
    assert applied.failed == []
    assert kube.deleted == [("/api/v1/namespaces/ns/pods/tiny-controller-2", "pod-uid")]


def test_a_keyless_deletion_pod_never_runs_as_nor_deletes_an_account_spotrl_did_not_make() -> None:
    doc = job()
    doc["spec"]["checkpoint"] = {"storage": "s3://bucket/ns/tiny", "retentionPolicy": "Delete"}
    kube = Accounts(doc, someones_account())
    actuator = Actuator(kube, Settings(), clock=Clock())  # type: ignore[arg-type]
    outcome = actuator.delete_cuts(copy.deepcopy(doc), "s3://bucket/ns/tiny")
    assert outcome is not None
    assert (outcome.type, outcome.reason) == ("Warning", "CutsNotDeleted")
    assert "would run as ServiceAccount tiny-runtime, which SpotRL did not make" in outcome.message
    assert [u for u, _, _ in kube.sent if "/events" not in u] == [], "nothing created or patched"
    assert kube.deleted == [], "nothing deleted"

    # The job's own account: held (guarded by the version read), and later deleted by its uid.
    mine = resources.service_account(REF, Settings())
    mine["metadata"].update(uid="mine", resourceVersion="3")
    kube = Accounts(doc, mine)
    actuator = Actuator(kube, Settings(), clock=Clock())  # type: ignore[arg-type]
    assert actuator.delete_cuts(copy.deepcopy(doc), "s3://bucket/ns/tiny") is None
    ((url, patch, _), (pods_url, pod, _)) = [s for s in kube.sent if "/events" not in s[0]]
    assert url.endswith("/serviceaccounts/tiny-runtime")
    assert patch["metadata"]["ownerReferences"] is None
    assert patch["metadata"]["resourceVersion"] == "3"
    assert pods_url.endswith("/pods")
    assert pod["spec"]["serviceAccountName"] == "tiny-runtime"
    kube.account = {**resources.retention_service_account(REF, Settings())}
    kube.account["metadata"] = {**kube.account["metadata"], "uid": "mine"}
    actuator._let_go_identity(REF)
    assert kube.deleted == [("/api/v1/namespaces/ns/serviceaccounts/tiny-runtime", "mine")]
