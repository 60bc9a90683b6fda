"""The operator's edges, on the test control plane with real operator processes: a leader cut
off from the API server, a namespace deleted under its jobs, a budget deleted by hand, a job
made again under its name, and many nodes going Unknown at once."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from operator_harness import NOWHERE, Jobs, OperatorProcess, tiny_job, wait_until

from spotrl_e2e.cluster import Cluster
from spotrl_e2e.kube import path
from spotrl_e2e.stallproxy import StallProxy

pytestmark = [pytest.mark.cluster]
PENDING = {"scheduling": {"nodeSelector": NOWHERE}}
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
Obj = dict[str, Any]


def stamped(log: str, needle: str) -> list[datetime]:
    """When each line of an operator's log that contains ``needle`` was written."""
    out = []
    for line in log.splitlines():
        m = STAMP.match(line)
        if m and needle in line:
            out.append(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f"))
    return out


def through(proxy: StallProxy, kubeconfig: Path, file: Path) -> Path:
    """The kubeconfig, its server reached through the proxy."""
    config = yaml.safe_load(kubeconfig.read_text())
    for entry in config["clusters"]:
        entry["cluster"]["server"] = f"https://127.0.0.1:{proxy.port}"
    file.write_text(yaml.safe_dump(config))
    return file


def test_a_leader_whose_api_calls_stall_stops_acting_before_the_standby_leads(
    cluster: Cluster,
    namespace: str,
    operator_identity: tuple[str, Path],
    start_operator: Callable[..., OperatorProcess],
    jobs: Jobs,
    tmp_path: Path,
) -> None:
    """A partition between the leader and the API server: its renewals hang. It must stop
    writing, and exit, before the standby takes the Lease; the write log of both shows it."""
    lease_ns, kubeconfig = operator_identity
    server = urlsplit(cluster.server)
    proxy = StallProxy((server.hostname or "127.0.0.1", server.port or 443))
    stalled_config = through(proxy, kubeconfig, tmp_path / "through-proxy.kubeconfig")
    leader = OperatorProcess(cluster, stalled_config, lease_ns, tmp_path, "cut-off", ("--log-writes",))
    try:
        leader.start()
        standby = start_operator(args=("--log-writes",), wait="standby", name="standby")
        jobs.create(tiny_job("a", checkpoint={"storage": "s3://bucket-x/a"}, **PENDING))
        jobs.wait("a", lambda s: s.get("attempt") == 1, 20, "job a started by the leader")
        assert stamped(leader.log(), "spotrl.kube.writes: POST"), "the write log shows the leader's creates"

        proxy.stall()
        wait_until(lambda: "ready: running RLJobs" in standby.log(), 30, "the standby to take over")
        wait_until(lambda: not leader.running(), 10, "the cut-off leader to exit")
        assert leader.process.exit_code() == 1

        cut_off, took_over = leader.log(), standby.log()
        (stopped,) = stamped(cut_off, "lost the lease")
        # "exiting: the leader Lease was lost", then "exiting hard: ..." when Kopf is slow to stop:
        # the last one is when the process ended.
        exited = max(stamped(cut_off, "exiting"), default=None)
        (leading,) = stamped(took_over, "leading as")
        last_write = max(stamped(cut_off, "spotrl.kube.writes:"))
        assert last_write < leading, "the cut-off leader wrote after the standby led"
        assert stopped < leading
        assert exited is not None, f"no exit logged:\n{cut_off[-3000:]}"
        assert exited < leading, "the cut-off leader still ran when the standby led"

        # The new leader acts, alone: the job goes on under it.
        jobs.patch_spec("a", {"suspend": True})
        jobs.wait("a", lambda s: s.get("phase") == "Suspended", 30, "the new leader suspends job a")
        assert min(stamped(standby.log(), "spotrl.kube.writes:")) > last_write
    finally:
        proxy.close()
        leader.stop()


def test_a_namespace_deleted_with_jobs_in_every_phase_and_retention_delete_finishes(
    cluster: Cluster, start_operator: Callable[..., OperatorProcess]
) -> None:
    """In a namespace being deleted no pod can start, so no deletion pod can delete the cuts:
    the finalizer says where they stay and lets each job go."""
    operator = start_operator()
    ns = cluster.create_namespace("reliability-ns", pod_security="restricted")
    jobs = Jobs(cluster, ns)

    def job(name: str, **extra: Any) -> Obj:
        storage = {"storage": f"s3://bucket-x/spotrl/{ns}/{name}", "retentionPolicy": "Delete"}
        return tiny_job(name, checkpoint=storage, **PENDING, **extra)

    jobs.create(job("pending"))
    jobs.create(job("suspended", suspend=True))
    jobs.create(job("succeeded"))
    jobs.create(job("failed"))
    jobs.wait("pending", lambda s: s.get("attempt") == 1, 20, "pending started")
    jobs.wait("suspended", lambda s: s.get("phase") == "Suspended", 20, "suspended")
    for name, phase in (("succeeded", "Succeeded"), ("failed", "Failed")):
        jobs.wait(name, lambda s: s.get("attempt") == 1, 20, f"{name} started")
        jobs.patch_status(name, {"phase": phase})
    cluster.delete_namespace(ns, wait=True, timeout=90)
    said = operator.log()
    for name in ("pending", "suspended", "succeeded", "failed"):
        assert f"{ns}/{name} deleted: CutsNotDeleted" in said, said[-3000:]
    assert "the namespace is being deleted" in said


def test_a_budget_deleted_by_hand_is_made_again_closed(
    cluster: Cluster, namespace: str, operator: OperatorProcess, jobs: Jobs
) -> None:
    admin = cluster.admin()
    created = jobs.create(tiny_job("tiny", checkpoint={"storage": "s3://bucket-x/tiny"}, **PENDING))
    jobs.wait("tiny", lambda s: s.get("attempt") == 1, 20, "started")
    url = path("policy/v1", "poddisruptionbudgets", namespace, "tiny-controller")
    first = admin.wait_for(url, lambda o: o is not None, 20, "the budget")
    assert first is not None
    admin.delete(url)
    again = admin.wait_for(
        url, lambda o: o is not None and o["metadata"]["uid"] != first["metadata"]["uid"], 20, "the budget again"
    )
    assert again is not None
    assert again["spec"]["minAvailable"] == 1, "made again closed: a drain waits for the barrier"
    assert [o["uid"] for o in again["metadata"]["ownerReferences"]] == [created["metadata"]["uid"]]
    service = path("v1", "services", namespace, "tiny")
    admin.delete(service)
    made = admin.wait_for(service, lambda o: o is not None, 20, "the Service again")
    assert made is not None


def test_a_job_made_again_under_its_name_never_adopts_the_old_ones_objects(
    cluster: Cluster, namespace: str, operator: OperatorProcess, jobs: Jobs
) -> None:
    """The old job's Service outlives it (a finalizer holds it, as a slow garbage collector
    would): the new job refuses it, says why, and makes its own once it is gone."""
    admin = cluster.admin()
    spec = {"checkpoint": {"storage": "s3://bucket-x/tiny"}, **PENDING}
    old = jobs.create(tiny_job("tiny", **spec))
    jobs.wait("tiny", lambda s: s.get("attempt") == 1, 20, "the first job started")
    service = path("v1", "services", namespace, "tiny")
    # The attempt is written before the pod and its objects are made: wait for the Service.
    admin.wait_for(service, lambda o: o is not None, 20, "the first job's Service")
    admin.patch(service, {"metadata": {"finalizers": ["test.spotrl.dev/hold"]}})
    try:
        jobs.delete("tiny")
        held = admin.get(service)
        assert held["metadata"].get("deletionTimestamp") is None or held["metadata"]["finalizers"]
        new = jobs.create(tiny_job("tiny", **spec))
        new_uid = new["metadata"]["uid"]
        assert new_uid != old["metadata"]["uid"]
        st = jobs.wait(
            "tiny",
            lambda s: any(c.get("reason") == "OwnedByAnotherJob" for c in s.get("conditions") or []),
            30,
            "the new job to say the old Service is not its own",
        )
        assert st.get("attempt", 0) <= 1
        assert [p["metadata"]["name"] for p in jobs.pods("tiny")] == [], "no pod before its objects are its own"
    finally:
        admin.patch(service, {"metadata": {"finalizers": None}})
    jobs.wait("tiny", lambda s: s.get("attempt") == 1, 30, "the new job started once the old Service went")
    for kind, name in (("serviceaccounts", "tiny-runtime"), ("services", "tiny")):
        obj = admin.wait_for(path("v1", kind, namespace, name), lambda o: o is not None, 20, name)
        assert obj is not None
        assert [o["uid"] for o in obj["metadata"]["ownerReferences"]] == [new_uid]
    for kind, name in (("roles", "tiny-runtime"), ("rolebindings", "tiny-runtime")):
        obj = admin.get(path("rbac.authorization.k8s.io/v1", kind, namespace, name))
        assert [o["uid"] for o in obj["metadata"]["ownerReferences"]] == [new_uid]
    pdb = admin.get(path("policy/v1", "poddisruptionbudgets", namespace, "tiny-controller"))
    assert [o["uid"] for o in pdb["metadata"]["ownerReferences"]] == [new_uid]
