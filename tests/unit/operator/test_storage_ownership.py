"""Two RLJobs on one storage, and a controller that refuses its storage: the newer job waits
(``StorageConflict``) with no controller pod, a refusal (exit 3) is a configuration error
(``StorageRefused``) that counts no crash and waits for a changed spec."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from spotrl_operator.observe import Snapshot, job_storage, world_of
from spotrl_operator.reconcile import reconcile
from spotrl_operator.settings import Settings
from spotrl_operator.storage_overlap import JobStorage, conflict, overlaps
from spotrl_operator.world import CreateControllerPod, DeletePod, Event, Plan, PodView, World
from spotrl_runtime.api.rljob import EXIT_REFUSED, RLJobStatus, parse_spec

T0 = datetime(2026, 12, 2, 12, 0, 0, tzinfo=UTC)
SPEC = parse_spec(
    {
        "policy": {"model": "builtin:tiny-arith"},
        "dataset": {"uri": "builtin:arithmetic"},
        "reward": {"name": "arithmetic_exact"},
        "training": {"totalSteps": 30},
        "failureBudget": {"maxCrashes": 2, "backoffSeconds": 10},
    }
)


def js(name: str, storage: str, created: str = "2026-12-02T10:00:00Z", ns: str = "team-a", ep: str = "") -> JobStorage:
    return JobStorage(ns, name, created, storage, ep)


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("s3://bkt/runs/a", "s3://bkt/runs/a", True),
        ("s3://bkt/runs/a/", "s3://bkt//runs/a", True),  # slashes do not make another store
        ("s3://bkt/runs", "s3://bkt/runs/a", True),  # nested: one store inside the other
        ("s3://bkt", "s3://bkt/runs/a", True),
        ("s3://bkt/runs/a", "s3://bkt/runs/ab", False),  # a common string prefix is not a folder
        ("s3://bkt/runs/a", "s3://other/runs/a", False),
        ("/data/cuts", "/data/cuts/../cuts/x", True),
        ("/data/cuts", "file:///data/cuts", True),
        ("/data/cuts", "data/cuts", False),  # relative and absolute: not the same place
        ("s3://data/cuts", "/data/cuts", False),
    ],
)
def test_which_storages_overlap(a: str, b: str, same: bool) -> None:
    assert overlaps(js("x", a), js("y", b)) is same
    assert overlaps(js("y", b), js("x", a)) is same


def test_the_same_bucket_on_two_endpoints_is_two_stores() -> None:
    assert not overlaps(js("x", "s3://b/p", ep="http://minio-a:9000"), js("y", "s3://b/p", ep="http://minio-b:9000"))
    assert overlaps(js("x", "s3://b/p", ep="http://minio-a:9000/"), js("y", "s3://b/p", ep="http://minio-a:9000"))


def test_the_newer_job_waits_for_the_older_and_names_it() -> None:
    older = js("first", "s3://bkt/shared", "2026-12-02T10:00:00Z")
    newer = js("second", "s3://bkt/shared/sub", "2026-12-02T10:05:00Z")
    unrelated = js("third", "s3://bkt/elsewhere", "2026-12-02T09:00:00Z")
    peers = [older, newer, unrelated]
    assert conflict(older, peers) is None, "the older job runs"
    why = conflict(newer, peers)
    assert why is not None
    assert "overlaps the storage of RLJob team-a/first (s3://bkt/shared)" in why
    assert "give this job its own spec.checkpoint.storage" in why
    same = js("second", "s3://bkt/shared", "2026-12-02T10:05:00Z")
    assert "is also the storage of RLJob team-a/first" in (conflict(same, peers) or "")
    # Created in the same second: namespace and name decide, the same way for both.
    twin = js("a-twin", "s3://bkt/shared", "2026-12-02T10:00:00Z")
    assert (conflict(twin, [older, twin]) is None) != (conflict(older, [older, twin]) is None)


def test_the_same_store_holds_the_newer_job_in_any_namespace() -> None:
    older = js("first", "s3://bkt/shared", "2026-12-02T10:00:00Z", ns="team-a")
    for ns in ("team-a", "team-b"):
        newer = js("second", "s3://bkt/shared/", "2026-12-02T10:05:00Z", ns=ns)
        assert "is also the storage of RLJob team-a/first" in (conflict(newer, [older, newer]) or "")
        assert conflict(older, [older, newer]) is None


def test_nested_stores_in_one_namespace_hold_the_newer_job_inner_or_outer() -> None:
    outer = js("outer", "s3://bkt/runs", "2026-12-02T10:00:00Z")
    inner = js("inner", "s3://bkt/runs/a", "2026-12-02T10:05:00Z")
    assert "overlaps the storage of RLJob team-a/outer" in (conflict(inner, [outer, inner]) or "")
    assert conflict(outer, [outer, inner]) is None
    # The other way round: the newer job encloses the older one's store.
    late_outer = js("outer", "s3://bkt/runs", "2026-12-02T10:10:00Z")
    assert "encloses the storage of RLJob team-a/inner" in (conflict(late_outer, [late_outer, inner]) or "")


def test_an_older_bucket_root_in_one_namespace_holds_no_newer_job_of_another() -> None:
    root = js("everything", "s3://bkt", "2026-12-02T10:00:00Z", ns="team-a")
    tenant = js("run", "s3://bkt/team-b/run", "2026-12-02T10:05:00Z", ns="team-b")
    assert conflict(tenant, [root, tenant]) is None, "a too-wide storage is its owner's problem"
    assert conflict(root, [root, tenant]) is None
    # The same, for the operator's default root plus <namespace>/<name> under an explicit prefix.
    wide = js("wide", "s3://bkt/spotrl", "2026-12-02T10:00:00Z", ns="team-a")
    default = js("tiny", "s3://bkt/spotrl/team-b/tiny", "2026-12-02T10:05:00Z", ns="team-b")
    assert conflict(default, [wide, default]) is None


def test_a_newer_job_of_another_namespace_whose_storage_encloses_an_older_ones_waits() -> None:
    older = js("run", "s3://bkt/team-a/run", "2026-12-02T10:00:00Z", ns="team-a")
    wide = js("everything", "s3://bkt", "2026-12-02T10:05:00Z", ns="team-b")
    why = conflict(wide, [older, wide])
    assert why is not None
    assert "s3://bkt encloses the storage of RLJob team-a/run (s3://bkt/team-a/run)" in why
    assert "give this job its own spec.checkpoint.storage" in why
    assert conflict(older, [older, wide]) is None


def test_a_finished_job_holds_nobody() -> None:
    for phase_done in (True, False):
        older = js("first", "s3://bkt/shared", "2026-12-02T10:00:00Z")
        older = replace(older, finished=phase_done)
        newer = js("second", "s3://bkt/shared", "2026-12-02T10:05:00Z")
        assert (conflict(newer, [older, newer]) is None) is phase_done
    # A finished job passed over, the next older one that holds still counts.
    done = replace(js("done", "s3://bkt/shared", "2026-12-02T09:00:00Z"), finished=True)
    live = js("live", "s3://bkt/shared", "2026-12-02T09:30:00Z")
    newer = js("second", "s3://bkt/shared", "2026-12-02T10:05:00Z")
    assert "RLJob team-a/live" in (conflict(newer, [done, live, newer]) or "")


def test_the_effective_storage_is_the_default_root_plus_namespace_and_name() -> None:
    settings = Settings(default_storage="s3://bkt/spotrl", default_s3_endpoint="http://s3:9000")
    job = {
        "metadata": {"name": "tiny", "namespace": "team-a", "creationTimestamp": "2026-12-02T10:00:00Z"},
        "spec": SPEC.model_dump(by_alias=True, exclude_none=True),
    }
    assert job_storage(job, settings) == JobStorage(
        "team-a", "tiny", "2026-12-02T10:00:00Z", "s3://bkt/spotrl/team-a/tiny", "http://s3:9000"
    )
    assert job_storage({**job, "spec": {"not": "a spec"}}, settings) is None
    assert job_storage(job, Settings()) is None, "no storage anywhere: said by InvalidConfiguration instead"

    # world_of: a job whose own storage (a default) sits inside an older job's explicit one.
    other = js("old", "s3://bkt/spotrl", "2026-12-01T10:00:00Z", ep="http://s3:9000")
    snap = Snapshot(job=job, peers=(other, job_storage(job, settings)))  # type: ignore[arg-type]
    w = world_of(snap, settings, now=T0)
    assert w.storage_conflict is not None
    assert "RLJob team-a/old" in w.storage_conflict
    assert world_of(Snapshot(job=job, peers=()), settings, now=T0).storage_conflict is None


def world(**kw: object) -> World:
    return replace(World(now=T0, generation=1, spec=SPEC, status=RLJobStatus()), **kw)  # type: ignore[arg-type]


def events(plan: Plan) -> list[str]:
    return [a.reason for a in plan.actions if isinstance(a, Event)]


def creates(plan: Plan) -> list[CreateControllerPod]:
    return [a for a in plan.actions if isinstance(a, CreateControllerPod)]


def test_a_job_on_an_older_jobs_storage_starts_no_controller_until_that_is_fixed() -> None:
    why = "the checkpoint storage s3://b/x is also the storage of RLJob team-a/first (s3://b/x) ..."
    p1 = reconcile(world(storage_conflict=why))
    assert creates(p1) == []
    assert p1.status is not None
    assert p1.status.phase == "Pending"
    assert p1.status.message == why
    (cond,) = [c for c in p1.status.conditions if c.type == "StorageConflict"]
    assert (cond.status, cond.reason, cond.message) == ("True", "StorageShared", why)
    assert events(p1).count("StorageConflict") == 1
    assert p1.status.attempt == 0

    p2 = reconcile(world(now=T0 + timedelta(seconds=30), status=p1.status, storage_conflict=why))
    assert creates(p2) == []
    assert "StorageConflict" not in events(p2), "said once"

    p3 = reconcile(world(now=T0 + timedelta(seconds=60), status=p2.status or p1.status))  # the other moved
    assert creates(p3) == [CreateControllerPod(1, frozenset())]
    assert p3.status is not None
    (cond,) = [c for c in p3.status.conditions if c.type == "StorageConflict"]
    assert (cond.status, cond.reason) == ("False", "OwnStorage")


def test_a_running_job_keeps_running_when_a_conflict_appears_but_is_told() -> None:
    st = RLJobStatus(phase="Running", attempt=1, step=3, step_attempt=1)
    pod = PodView(name="j-controller-1", attempt=1, phase="Running", node="n1")
    plan = reconcile(world(status=st, pods=(pod,), storage_conflict="overlaps RLJob team-a/first"))
    assert not [a for a in plan.actions if isinstance(a, DeletePod)], "it proved its store when it started"
    assert plan.status is not None
    assert any(c.type == "StorageConflict" and c.status == "True" for c in plan.status.conditions)


def refused_pod(attempt: int = 1) -> PodView:
    return PodView(
        name=f"j-controller-{attempt}",
        attempt=attempt,
        phase="Failed",
        node="n1",
        exit_code=EXIT_REFUSED,
        exit_message="spotrl: [job_identity] s3://b/x/JOB.json: the store belongs to job 'a', not 'j'; point ...",
    )


def test_a_refused_storage_is_a_configuration_error_not_a_crash() -> None:
    st = RLJobStatus(phase="Pending", attempt=1, controller_pod="j-controller-1")
    p1 = reconcile(world(status=st, pods=(refused_pod(),)))
    assert [a for a in p1.actions if isinstance(a, DeletePod)] == [DeletePod("j-controller-1")]
    assert p1.status is not None
    assert p1.status.restarts == 0, "no crash counted"
    assert p1.status.retry_after is None
    assert p1.status.refused_generation == 1
    assert p1.status.phase == "Pending"
    (cond,) = [c for c in p1.status.conditions if c.type == "StorageRefused"]
    assert cond.status == "True"
    assert "the store belongs to job 'a', not 'j'" in cond.message
    assert "StorageRefused" in events(p1)
    assert "ControllerCrashed" not in events(p1)

    # A pass whose cache still has the failed pod: deleted again, nothing said or counted again.
    p2 = reconcile(world(status=p1.status, pods=(refused_pod(),)))
    assert p2.status is None or p2.status.refused_generation == 1
    assert "StorageRefused" not in events(p2)

    # The pod is gone: many passes later, still no controller, no budget spent.
    st3 = p2.status or p1.status
    for k in range(1, 6):
        p3 = reconcile(world(now=T0 + timedelta(minutes=k), status=st3))
        assert creates(p3) == []
        st3 = p3.status or st3
    assert st3.restarts == 0
    assert st3.attempt == 1

    # The user fixes the spec (a new generation): attempt 2, counted neither as crash nor preemption.
    p4 = reconcile(world(now=T0 + timedelta(minutes=10), generation=2, status=st3))
    assert creates(p4) == [CreateControllerPod(2, frozenset())]
    assert p4.status is not None
    assert p4.status.refused_generation is None
    assert p4.status.preemptions == 0
    assert p4.status.restarts == 0
    assert p4.status.recovering is None
    (cond,) = [c for c in p4.status.conditions if c.type == "StorageRefused"]
    assert (cond.status, cond.reason) == ("False", "SpecChanged")
