"""RLJobs queued by a real Kueue (v0.17, built from its Go module): the operator (``--kueue``,
with the chart's RBAC for it) is the RLJob's external controller. On the test control plane
Kueue's manager is a local process and the operator a subprocess; on kind
(``SPOTRL_E2E_TARGET=kind``) Kueue is a Deployment in the cluster and the operator the chart's
two replicas, both installed by ``e2e/kind/run.sh``.

- A job larger than the whole quota stays Queued, with Kueue's own reason, and starts no pod.
- One ClusterQueue with quota for one tiny job: a low-priority job trains; a high-priority job
  preempts it. The operator that asked for the eviction's barrier cut is killed and another
  takes over (on the test control plane with the cut held until then, so that the quota is
  seen kept meanwhile; on kind the leading replica's pod is force-deleted as soon as the cut is
  asked for). The quota stays the low job's until the cut commits and its pods are gone, and
  the high job starts only then. The high job ends, its Workload is Finished, and the low job
  is admitted again and resumes from its barrier cut.
- A Workload deleted while its job trains keeps its quota (Kueue's in-use finalizer) until the
  job has stopped through a barrier cut; then a new Workload, and the job resumes.
- Borrowing: two ClusterQueues in one cohort; a job runs on the lender's idle quota and the
  lender's job reclaims it through a barrier cut; the borrower resumes afterwards.

Every effective stream equals a never-preempted run's.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from operator_harness import (
    TARGET,
    Jobs,
    JobStorage,
    OperatorProcess,
    apply_crd,
    install_operator_identity,
    lease_holder,
    wait_until,
)
from test_dry_run import SETTINGS as DRY_SETTINGS
from test_dry_run import SPECS
from test_preemption import assert_same_stream, assert_stopped_after, succeeded, tiny_job, training

from spotrl_e2e.kueue import (
    API,
    MANAGER,
    NAMESPACE,
    Kueue,
    LocalKueue,
    cluster_queue,
    local_queue,
    priority_class,
    resource_flavor,
)
from spotrl_operator import queueing
from spotrl_operator.resources import JobRef
from spotrl_runtime.api.rljob import parse_spec

pytestmark = [pytest.mark.cluster]
SPOT = {"karpenter.sh/capacity-type": "spot"}
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
OPERATOR_NAMESPACE = os.environ.get("SPOTRL_E2E_OPERATOR_NAMESPACE", "spotrl-system")


@pytest.fixture(scope="module")
def kueue(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kueue]:
    """Kueue with a ResourceFlavor ``spot`` (the spot nodes) and two WorkloadPriorityClasses."""
    local: LocalKueue | None = None
    if TARGET == "kind":
        k = Kueue(request.getfixturevalue("kind_cluster"))
        k.cluster.kubectl("rollout", "status", "-n", NAMESPACE, f"deployment/{MANAGER}", "--timeout=120s")
    else:
        cluster = request.getfixturevalue("spotrl_cluster_session")
        cluster.tools.require("kueue")
        assert cluster.tools.kueue is not None
        assert cluster.tools.kueue_manifests is not None
        k = local = LocalKueue(
            cluster,
            cluster.controlplane.pki,
            cluster.tools.kueue,
            cluster.tools.kueue_manifests,
            tmp_path_factory.mktemp("kueue"),
        )
        try:
            local.start()
        except Exception:
            local.stop()
            raise
    k.apply(resource_flavor("spot", SPOT), priority_class("low", 100), priority_class("high", 1000))
    yield k
    for kind, name in (("resourceflavor", "spot"), ("workloadpriorityclass", "low"), ("workloadpriorityclass", "high")):
        k.delete(kind, name)
    if local is not None:
        local.stop()


@dataclass
class Queued:
    """A test's queued jobs: the RLJobs, their ClusterQueue (``cq``, quota for one tiny job: its
    controller asks for 500m and 4Gi; LocalQueue ``lq`` in the test's namespace), and the
    operators: on the test control plane started by :meth:`start_operator` (with ``--kueue``,
    the chart's identity with ``kueue.enabled=true``), on kind the chart's."""

    jobs: Jobs
    cq: str
    kubeconfig: Path | None = None
    lease_ns: str | None = None
    tmp_path: Path | None = None
    started: list[OperatorProcess] = field(default_factory=list)

    def start_operator(self, *args: str) -> OperatorProcess | None:
        if TARGET == "kind":
            self.jobs.cluster.kubectl(
                "rollout", "status", "deployment/spotrl", "-n", OPERATOR_NAMESPACE, "--timeout=120s"
            )
            return None
        assert self.kubeconfig is not None
        assert self.lease_ns is not None
        assert self.tmp_path is not None
        op = OperatorProcess(self.jobs.cluster, self.kubeconfig, self.lease_ns, self.tmp_path, args=("--kueue", *args))
        self.started.append(op)
        return op.start()


@pytest.fixture
def queued(e2e_cluster: Any, e2e_namespace: str, kueue: Kueue, request: pytest.FixtureRequest) -> Iterator[Queued]:
    cq = f"cq-{e2e_namespace}"[:63]
    kueue.apply(cluster_queue(cq, "spot", cpu="750m", memory="6Gi"), local_queue(e2e_namespace, "lq", cq))
    jobs = Jobs(e2e_cluster, e2e_namespace)
    q = Queued(jobs, cq)
    if TARGET != "kind":
        apply_crd(e2e_cluster)
        q.lease_ns = e2e_cluster.create_namespace("spotrl-system")
        q.tmp_path = request.getfixturevalue("tmp_path")
        q.kubeconfig = install_operator_identity(e2e_cluster, q.lease_ns, q.tmp_path, "kueue.enabled=true")
    try:
        yield q
    finally:
        jobs.cleanup()
        for op in reversed(q.started):
            op.stop()
        kueue.delete("clusterqueue", cq)
        if q.lease_ns is not None:
            e2e_cluster.delete_namespace(q.lease_ns)


def condition(st: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next((c for c in st.get("conditions") or [] if c["type"] == ctype), {})


@pytest.mark.kind_ci
def test_a_job_larger_than_the_quota_stays_queued_with_kueues_reason(
    queued: Queued, e2e_storage: JobStorage, kueue: Kueue
) -> None:
    jobs = queued.jobs
    queued.start_operator()
    job_name = "huge"
    jobs.create(_labelled(jobs, e2e_storage, job_name, training={"resources": {"cpu": "2", "memory": "4Gi"}}))
    st = jobs.wait(
        job_name, lambda s: "insufficient" in condition(s, "Queued").get("message", ""), 60, "Kueue's reason"
    )
    assert st["phase"] == "Queued"
    assert condition(st, "Queued")["status"] == "True"
    assert "cpu" in condition(st, "Queued")["message"], condition(st, "Queued")
    assert st["queue"]["name"] == "lq"
    assert st["queue"]["admitted"] is False
    (wl,) = kueue.workloads(jobs.ns)
    assert wl["metadata"]["name"] == st["queue"]["workload"]
    owner = wl["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("RLJob", job_name, True)
    requests = wl["spec"]["podSets"][0]["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert requests["cpu"] == "2", "the pod set carries the pods' own requests"
    assert jobs.pods(job_name) == [], "no pod before Kueue admits the job"
    jobs.said(job_name, {"Queued"})
    assert wl["metadata"]["finalizers"] == [queueing.IN_USE_FINALIZER], "Kueue's in-use finalizer, as its jobs have"

    # A Workload deleted while the job has no pod is let go at once, and made again.
    jobs.cluster.kubectl("delete", "-n", jobs.ns, f"workloads.kueue.x-k8s.io/{wl['metadata']['name']}", "--wait=false")
    wait_until(
        lambda: [w["metadata"]["uid"] for w in kueue.workloads(jobs.ns)] not in ([], [wl["metadata"]["uid"]]),
        30,
        "the Workload let go and made again",
    )
    st = jobs.wait(job_name, lambda s: "insufficient" in condition(s, "Queued").get("message", ""), 60, "queued again")
    assert st["phase"] == "Queued"
    # The job deleted: its Workload is let go and the garbage collector deletes it.
    jobs.delete(job_name)
    wait_until(lambda: kueue.workloads(jobs.ns) == [], 30, "the deleted job's Workload gone")


def _labelled(jobs: Jobs, storage: JobStorage, name: str, queue: str = "lq", **spec: Any) -> dict[str, Any]:
    """The tiny job with its queue label from the start (as a user applies it)."""
    if jobs.cluster.admin().get_or_none(f"/api/v1/namespaces/{jobs.ns}/secrets/s3") is None:
        jobs.cluster.admin().create(f"/api/v1/namespaces/{jobs.ns}/secrets", storage.secret())
    job = tiny_job(name, storage, {})
    job["metadata"]["labels"] = {QUEUE_LABEL: queue}
    for key, value in spec.items():
        job["spec"].setdefault(key, {}).update(value)
    return job


@pytest.mark.kind_ci
def test_a_higher_priority_preempts_through_a_barrier_cut_even_with_the_operator_restarted_in_it(
    queued: Queued,
    e2e_storage: JobStorage,
    kueue: Kueue,
    reference: dict[int, Any],
    tmp_path: Path,
) -> None:
    """The operator that asked for the eviction's barrier cut is killed and another takes over.
    On the test control plane the cut is held (failpoint ``cut.captured``) until then, and the
    quota is seen kept meanwhile; on kind the leading replica's pod is force-deleted as soon as
    the cut is asked for. The quota stays the low job's until the cut commits and its pods are
    gone, and the outcome is the same."""
    jobs, cq = queued.jobs, queued.cq
    held = tmp_path / "failpoints"
    held.mkdir()
    held.chmod(0o777)  # the pods' user writes its marks here
    env = ("--runtime-env", "SPOTRL_FAILPOINTS=cut.captured=120", "--runtime-env", f"SPOTRL_FAILPOINT_DIR={held}")
    first = queued.start_operator(*env)
    ns = jobs.ns
    low = _labelled(jobs, e2e_storage, "low", checkpoint={"barrierDeadlineSeconds": 90})
    low["metadata"]["labels"][PRIORITY_LABEL] = "low"
    jobs.create(low)
    st = jobs.wait("low", lambda s: (s.get("queue") or {}).get("admitted") is True, 60, "low admitted")
    assert st["queue"]["clusterQueue"] == cq
    assert st["queue"]["flavors"] == {"controller": ["spot"]}
    training(jobs, "low", 2)
    (pod,) = jobs.pods("low")
    assert pod["spec"]["nodeSelector"] == SPOT, "the flavor's node labels"
    node = jobs.cluster.admin().get(f"/api/v1/nodes/{pod['spec']['nodeName']}")
    assert node["metadata"]["labels"].get("karpenter.sh/capacity-type") == "spot", node["metadata"]["name"]

    high = _labelled(jobs, e2e_storage, "high")
    high["metadata"]["labels"][PRIORITY_LABEL] = "high"
    jobs.create(high)
    if first is None:  # kind: the chart's replicas
        jobs.wait("low", lambda s: bool(s.get("barrier")), 60, "the eviction's barrier request")
        kill_the_leading_replica(jobs.cluster)
    else:
        wait_until((held / "cut.captured").exists, 60, "the eviction's barrier cut, held")
        low_wl = next(w for w in kueue.workloads(ns) if w["metadata"]["ownerReferences"][0]["name"] == "low")
        wl_status = kueue_wl(kueue, ns, low_wl["metadata"]["name"])["status"]
        assert condition(wl_status, "Evicted")["status"] == "True"
        assert condition(wl_status, "QuotaReserved")["status"] == "True", "the quota is kept while the cut is held"
        assert jobs.pods("high") == [], "the preemptor waits for the cut"
        first.kill(signal.SIGKILL)
        queued.start_operator(*env)
        (held / "cut.captured.release").touch()

    st = jobs.wait(
        "low", lambda s: ((s.get("queue") or {}).get("lastEviction") or {}).get("releasedAt"), 120, "quota released"
    )
    eviction = st["queue"]["lastEviction"]
    assert eviction["reason"] == "Preempted"
    assert "prioritization in the ClusterQueue" in eviction["message"], eviction
    assert st["barrier"]["reason"] == "kueue-eviction"
    assert st["barrier"]["state"] == "Committed"
    assert eviction["cutId"] == st["barrier"]["cutId"], "the eviction names its barrier cut"
    assert st["phase"] == "Queued"
    assert_stopped_after(jobs.cluster, ns, pod["metadata"]["name"], st["barrier"]["committedAt"])

    # The high job starts only once the low job's quota is back.
    training(jobs, "high", 1)
    (high_pod,) = jobs.pods("high")
    assert high_pod["metadata"]["creationTimestamp"][:19] >= eviction["releasedAt"][:19]
    succeeded(jobs, "high")
    high_wl = next(w for w in kueue.workloads(ns) if w["metadata"]["ownerReferences"][0]["name"] == "high")
    wait_until(
        lambda: (
            condition(kueue_wl(kueue, ns, high_wl["metadata"]["name"])["status"], "Finished").get("status") == "True"
        ),
        30,
        "the high job's Workload Finished",
    )

    # The low job is admitted again and resumes from its barrier cut.
    training(jobs, "low", st["lastCut"]["step"] + 1, attempt=2)
    st = succeeded(jobs, "low")
    assert (st["preemptions"], st["restarts"]) == (0, 0), "a Kueue eviction is not a node preemption"
    assert st["queue"]["evictions"] == 1, "counted once, across the operator's restart"
    jobs.said("low", {"Admitted", "Evicted", "BarrierRequested", "BarrierCommitted", "QuotaReleased"})
    committed = [e for e in jobs.events("low") if e["reason"] == "BarrierCommitted"]
    assert sum(e.get("count") or 1 for e in committed) == 1, "one barrier cut, not two"
    assert_same_stream(reference, e2e_storage, "low")
    assert_same_stream(reference, e2e_storage, "high")


def test_a_deleted_workload_keeps_its_quota_until_the_job_stopped_through_a_barrier_cut(
    queued: Queued, e2e_storage: JobStorage, kueue: Kueue, reference: dict[int, Any]
) -> None:
    """Its Workload deleted while the job trains (as ``kubectl delete workload`` does): with
    Kueue's in-use finalizer on, the Workload, and so its quota, outlives the job's pod; the job
    takes a barrier cut, stops, lets the Workload go, makes a new one and resumes from the cut."""
    jobs = queued.jobs
    queued.start_operator()
    jobs.create(_labelled(jobs, e2e_storage, "tiny"))
    jobs.wait("tiny", lambda s: (s.get("queue") or {}).get("admitted") is True, 60, "admitted")
    training(jobs, "tiny", 2)
    (wl,) = kueue.workloads(jobs.ns)
    (pod,) = jobs.pods("tiny")
    jobs.cluster.kubectl("delete", "-n", jobs.ns, f"workloads.kueue.x-k8s.io/{wl['metadata']['name']}", "--wait=false")
    # Which goes first, to a tenth of a second: the pod, or the Workload that holds the quota.
    listed = {"pod": lambda: jobs.pods("tiny"), "workload": lambda: kueue.workloads(jobs.ns)}
    uid = {"pod": pod["metadata"]["uid"], "workload": wl["metadata"]["uid"]}
    gone: dict[str, float] = {}
    start = time.monotonic()
    while len(gone) < 2 and time.monotonic() - start < 120:
        now = time.monotonic()
        for what in sorted(set(uid) - set(gone)):
            if uid[what] not in {o["metadata"]["uid"] for o in listed[what]()}:
                gone[what] = now
        time.sleep(0.1)
    assert set(gone) == {"pod", "workload"}, gone
    assert gone["pod"] <= gone["workload"], f"the Workload went {gone['pod'] - gone['workload']:.1f} s before the pod"
    jobs.said("tiny", {"BarrierRequested", "BarrierCommitted"})
    (committed,) = [e for e in jobs.events("tiny") if e["reason"] == "BarrierCommitted"]
    cut_id = committed["message"].rsplit(" ", 1)[-1]
    training(jobs, "tiny", 1, attempt=2)
    st = succeeded(jobs, "tiny")
    assert st["resume"]["cutId"] == cut_id, "resumed from the barrier cut"
    assert (st["preemptions"], st["restarts"]) == (0, 0)
    (again,) = kueue.workloads(jobs.ns)
    assert again["metadata"]["uid"] != wl["metadata"]["uid"], "a new Workload"
    assert_same_stream(reference, e2e_storage, "tiny")


def test_a_borrowing_job_is_reclaimed_through_a_barrier_cut_and_resumes(
    queued: Queued,
    e2e_storage: JobStorage,
    kueue: Kueue,
    reference: dict[int, Any],
) -> None:
    """Two ClusterQueues in one cohort: the borrower has no quota of its own and runs on the
    lender's idle quota; the lender's job reclaims it (barrier, quota back, resume)."""
    jobs = queued.jobs
    queued.start_operator()
    ns = jobs.ns
    cohort, lender, borrower = f"pool-{ns}"[:63], f"lend-{ns}"[:63], f"borrow-{ns}"[:63]
    kueue.apply(
        cluster_queue(lender, "spot", cpu="750m", memory="6Gi", cohort=cohort),
        cluster_queue(borrower, "spot", cpu="0", memory="0", cohort=cohort),
        local_queue(ns, "lq-lend", lender),
        local_queue(ns, "lq-borrow", borrower),
    )
    try:
        jobs.create(_labelled(jobs, e2e_storage, "borrower", queue="lq-borrow"))
        st = jobs.wait("borrower", lambda s: (s.get("queue") or {}).get("admitted") is True, 60, "admitted")
        assert st["queue"]["clusterQueue"] == borrower
        training(jobs, "borrower", 2)

        jobs.create(_labelled(jobs, e2e_storage, "lender", queue="lq-lend"))
        st = jobs.wait(
            "borrower",
            lambda s: ((s.get("queue") or {}).get("lastEviction") or {}).get("releasedAt"),
            120,
            "the borrower's quota given back",
        )
        eviction = st["queue"]["lastEviction"]
        assert eviction["reason"] == "Preempted"
        assert "reclamation within the cohort" in eviction["message"], eviction
        assert st["barrier"]["state"] == "Committed"
        assert eviction["cutId"] == st["barrier"]["cutId"]
        succeeded(jobs, "lender")
        training(jobs, "borrower", st["lastCut"]["step"] + 1, attempt=2)
        st = succeeded(jobs, "borrower")
        assert st["queue"]["evictions"] == 1
        assert_same_stream(reference, e2e_storage, "borrower")
        assert_same_stream(reference, e2e_storage, "lender")
    finally:
        jobs.cleanup()
        for cq in (lender, borrower):
            kueue.delete("clusterqueue", cq)


def kueue_wl(kueue: Kueue, namespace: str, name: str) -> dict[str, Any]:
    return next(w for w in kueue.workloads(namespace) if w["metadata"]["name"] == name)


def kill_the_leading_replica(cluster: Any) -> None:
    """kind: the chart's leading operator pod force-deleted (no grace: its process is killed);
    returns once the other replica holds the Lease."""
    leader = lease_holder(cluster, OPERATOR_NAMESPACE)
    assert leader, "no operator holds the Lease"
    cluster.kubectl("delete", "pod", leader, "-n", OPERATOR_NAMESPACE, "--grace-period=0", "--force")
    wait_until(
        lambda: lease_holder(cluster, OPERATOR_NAMESPACE) not in (None, leader), 60, "the standby to take the Lease"
    )


DRY_SPECS = {**SPECS, "standby": {**SPECS["tiny-cpu"], "standby": True}}


@pytest.mark.parametrize("spec_name", sorted(DRY_SPECS))
def test_the_api_server_and_kueues_webhooks_accept_every_workload_the_operator_builds(
    e2e_cluster: Any, e2e_namespace: str, kueue: Kueue, spec_name: str
) -> None:
    """Each spec's Workload (every example's among them), created with ``dryRun=All``: the
    Workload CRD's schema and CEL rules, and Kueue's own defaulting and validating webhooks."""
    spec = parse_spec(DRY_SPECS[spec_name])
    ref = JobRef(spec_name, e2e_namespace, "6f1c4c1e-0c55-4a51-9a4e-1a0c3d7f6e0b")
    priority = queueing.Priority("WorkloadPriorityClass", "high", 1000)
    body = queueing.workload(ref, spec, DRY_SETTINGS, "lq", priority)
    got = e2e_cluster.admin().create(f"{API}/namespaces/{e2e_namespace}/workloads", body, dryRun="All")
    sets = {s["name"]: s for s in got["spec"]["podSets"]}
    roles = ["controller"] + (["standby"] if spec.standby else [])
    roles += ["workers"] if spec.generation.worker_pods else []
    roles += ["trainers"] if spec.training.parallelism.trainer_pods else []
    assert list(sets) == roles
    assert got["spec"]["priority"] == 1000
    assert (
        got["metadata"]["annotations"][queueing.POD_SETS_ANNOTATION]
        == body["metadata"]["annotations"][queueing.POD_SETS_ANNOTATION]
    )
