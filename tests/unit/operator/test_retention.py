"""retentionPolicy: what counts as the job's, where a deletion may happen, and how the
operator reads its deletion pod."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from spotrl_operator import resources, retention
from spotrl_operator.settings import Settings
from spotrl_runtime.checkpoint.fence import ATTEMPTS
from spotrl_runtime.checkpoint.layout import AUDIT, CUTS, POINTER
from spotrl_runtime.controller.tensorboard import PREFIX as TENSORBOARD
from spotrl_runtime.storage import open_storage
from spotrl_runtime.storage.purge import JOB_KEYS, JOB_PREFIXES, job_prefix_problem, purge
from spotrl_runtime.storage.s3 import PROBES


def test_the_job_prefixes_are_the_checkpoint_layouts_names() -> None:
    assert set(JOB_PREFIXES) == {f"{ATTEMPTS}/", f"{CUTS}/", f"{AUDIT}/", f"{TENSORBOARD}/", f"{PROBES}/"}
    assert JOB_KEYS == (POINTER,)


@pytest.mark.parametrize(
    "module", ["spotrl_operator.retention", "spotrl_operator.handlers", "spotrl_runtime.commands.ckpt"]
)
def test_the_deletion_path_imports_without_torch(module: str) -> None:
    """The operator's image, which runs both the operator and the deletion pod, has no torch."""
    code = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.parametrize(
    ("uri", "ok"),
    [
        ("s3://b/spotrl/team-a/tiny", True),
        ("s3://b/team-a/tiny/", True),
        ("s3://b/spotrl/team-b/tiny", False),  # another namespace's prefix
        ("s3://b/spotrl/tiny/team-a", False),  # swapped
        ("s3://b/spotrl/team-a", False),  # the namespace's root: every job in it
        ("s3://b/spotrl/team-a/tiny-other", False),
        ("s3://b/spotrl/../team-a/tiny", False),
        ("s3://b/spotrl//team-a/tiny", False),
        ("s3://b/./team-a/tiny", False),
        ("s3:///team-a/tiny", False),  # no bucket
        ("s3://b", False),
    ],
)
def test_a_deletion_happens_only_under_the_jobs_own_prefix(uri: str, ok: bool) -> None:
    problem = job_prefix_problem(uri, "team-a", "tiny")
    assert (problem is None) == ok, problem


def job(storage: str | None, policy: str = "Delete", namespace: str = "team-a") -> dict:
    checkpoint: dict = {"retentionPolicy": policy}
    if storage:
        checkpoint["storage"] = storage
    return {
        "metadata": {"name": "tiny", "namespace": namespace, "uid": "u1"},
        "spec": {
            "policy": {"model": "builtin:tiny-arith"},
            "dataset": {"uri": "builtin:arithmetic"},
            "reward": {"name": "arithmetic_exact"},
            "training": {"totalSteps": 10},
            "checkpoint": checkpoint,
        },
    }


def test_decide_deletes_only_its_own_s3_prefix_and_says_why_not_otherwise() -> None:
    settings = Settings(default_storage="s3://bkt/spotrl")
    assert retention.decide(job(None), settings) == retention.DeleteCuts("s3://bkt/spotrl/team-a/tiny")
    assert retention.decide(job("s3://bkt/x/team-a/tiny"), settings) == retention.DeleteCuts("s3://bkt/x/team-a/tiny")
    refused = retention.decide(job("s3://bkt/spotrl/team-b/victim"), settings)
    assert isinstance(refused, retention.Outcome)
    assert (refused.type, refused.reason) == ("Warning", "CutsNotDeleted")
    assert "team-a/tiny" in refused.message
    assert "nothing was deleted" in refused.message
    kept = retention.decide(job(None, "Retain"), settings)
    assert isinstance(kept, retention.Outcome)
    assert kept.reason == "CutsRetained"
    local = retention.decide(job("/data/team-a/tiny"), settings)
    assert isinstance(local, retention.Outcome)
    assert local.reason == "CutsNotDeleted"


def test_a_job_in_a_refused_namespace_gets_no_deletion_pod_there() -> None:
    settings = Settings(default_storage="s3://bkt/spotrl", refused_namespaces=("kube-system", "team-a"))
    refused = retention.decide(job(None), settings)
    assert isinstance(refused, retention.Outcome)
    assert (refused.type, refused.reason) == ("Warning", "CutsNotDeleted")
    assert "runs no RLJob in namespace team-a" in refused.message
    assert retention.decide(job(None), Settings(default_storage="s3://bkt/spotrl")) == retention.DeleteCuts(
        "s3://bkt/spotrl/team-a/tiny"
    )


def pod(phase: str, state: dict) -> dict:
    return {"status": {"phase": phase, "containerStatuses": [{"name": "delete-cuts", "state": state}]}}


def test_the_deletion_pods_result_is_read_from_its_phase_and_termination_message() -> None:
    assert retention.pod_result(pod("Pending", {"waiting": {"reason": "ContainerCreating"}})) is None
    assert retention.pod_result(pod("Running", {"running": {}})) is None
    done = pod("Succeeded", {"terminated": {"exitCode": 0, "message": '{"root": "s3://bkt/a/t", "deleted": 7}'}})
    assert retention.pod_result(done) == ("Succeeded", '{"root": "s3://bkt/a/t", "deleted": 7}')
    assert "removed 7 objects" in retention.deleted_outcome("s3://bkt/a/t", retention.pod_result(done)[1]).message  # type: ignore[index]
    failed = retention.pod_result(pod("Failed", {"terminated": {"exitCode": 1, "message": "AccessDenied"}}))
    assert failed == ("Failed", "AccessDenied")
    pull = retention.pod_result(pod("Pending", {"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}}))
    assert pull == ("Failed", "ImagePullBackOff: no such image")


def test_the_deletion_pod_gets_the_jobs_secret_from_the_kubelet_and_no_token() -> None:
    from spotrl_runtime.api import rljob as api

    obj = job("s3://bkt/x/team-a/tiny")
    obj["spec"]["checkpoint"]["credentialsSecret"] = "s3"
    spec = api.parse_spec(obj["spec"])
    ref = resources.JobRef("tiny", "team-a", "u1")
    settings = Settings(retention_image="registry.example/spotrl-operator:1.2")
    p = resources.retention_pod(ref, spec, settings, "s3://bkt/x/team-a/tiny", 2)
    assert p["metadata"]["name"] == "tiny-retention-2"
    assert "ownerReferences" not in p["metadata"]
    assert resources.JOB_LABEL not in p["metadata"]["labels"], "stopping the job's pods must not stop it"
    c = p["spec"]["containers"][0]
    assert c["image"] == "registry.example/spotrl-operator:1.2"
    assert c["envFrom"] == [{"secretRef": {"name": "s3"}}]
    assert c["command"][:4] == ["spotrl", "ckpt", "delete", "s3://bkt/x/team-a/tiny"]
    assert c["args"][:2] == ["--job", "team-a/tiny"]
    assert p["spec"]["automountServiceAccountToken"] is False


def test_purge_deletes_what_the_job_owns_and_nothing_else(tmp_path: Path) -> None:
    store = open_storage(str(tmp_path / "team-a" / "tiny"))
    owned = [
        "cuts/0000000001/manifest.json",
        "audit/0000.jsonl",
        "attempts/0000000002",
        "tensorboard/events.out.tfevents.1.host.1.0.attempt-0",
        "LATEST.json",
        "JOB.json",
    ]
    others = ["notes/keep.txt", "cutsx/not-a-cut"]
    for key in owned + others:
        store.put_bytes(key, b"x")
    deleted: list[str] = []
    delete = store.delete
    store.delete = lambda key: (deleted.append(key), delete(key))[1]  # type: ignore[method-assign]
    assert sorted(purge(store)) == sorted(owned)
    assert sorted(i.key for i in store.list("")) == sorted(others)
    assert deleted[0] == "LATEST.json", "the pointer first: no restore finds a half-deleted cut"
    assert deleted[-1] == "JOB.json", "the identity last: a store half purged is still the job's"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).parent / "spotrl"), "ckpt", "delete", *args],
        capture_output=True,
        text=True,
        check=False,
    )


def test_ckpt_delete_refuses_a_root_that_is_not_the_jobs_prefix_and_deletes_nothing(tmp_path: Path) -> None:
    victim = open_storage(str(tmp_path / "team-b" / "victim"))
    victim.put_bytes("cuts/0000000001/manifest.json", b"{}")
    r = run_cli(str(tmp_path / "team-b" / "victim"), "--job", "team-a/tiny", "--yes")
    assert r.returncode == 2
    assert "not the job's own prefix" in r.stderr
    assert "Traceback" not in r.stderr
    assert [i.key for i in victim.list("")] == ["cuts/0000000001/manifest.json"]


def test_ckpt_delete_lists_without_yes_and_deletes_with_it(tmp_path: Path) -> None:
    root = tmp_path / "team-a" / "tiny"
    store = open_storage(str(root))
    store.put_bytes("cuts/0000000001/manifest.json", b"{}")
    store.put_bytes("LATEST.json", b"{}")
    r = run_cli(str(root), "--job", "team-a/tiny")
    assert r.returncode == 0
    assert "would delete" in r.stdout
    assert len(list(store.list(""))) == 2
    log = tmp_path / "termination-log"
    r = run_cli(str(root), "--job", "team-a/tiny", "--yes", "--termination-log", str(log))
    assert r.returncode == 0, r.stderr
    assert json.loads(log.read_text())["deleted"] == 2
    assert list(store.list("")) == []


def _deleted_job(policy: str = "Delete", deleted_seconds_ago: float = 0.0) -> dict:
    from datetime import UTC, datetime, timedelta

    from spotrl_runtime.api.times import rfc3339

    when = rfc3339(datetime.now(UTC) - timedelta(seconds=deleted_seconds_ago))
    return {
        "metadata": {"name": "tiny", "namespace": "team-a", "uid": "u1", "deletionTimestamp": when},
        "spec": {
            "policy": {"model": "builtin:tiny-arith"},
            "dataset": {"uri": "builtin:arithmetic"},
            "reward": {"name": "arithmetic_exact"},
            "training": {"totalSteps": 2},
            "checkpoint": {"storage": "s3://bkt/spotrl/team-a/tiny", "retentionPolicy": policy},
        },
    }


def test_the_finalizer_deadline_counts_from_the_deletion() -> None:
    from datetime import UTC, datetime

    now = datetime.now(UTC)
    assert not retention.past_deadline(_deleted_job(deleted_seconds_ago=10), 60, now)
    assert retention.past_deadline(_deleted_job(deleted_seconds_ago=61), 60, now)
    assert not retention.past_deadline({"metadata": {}}, 60, now)


def test_giving_up_says_where_the_cuts_stay_and_how_to_delete_them() -> None:
    settings = Settings()
    out = retention.gave_up(_deleted_job("Delete"), settings, "the namespace is being deleted")
    assert (out.type, out.reason) == ("Warning", "CutsNotDeleted")
    assert "s3://bkt/spotrl/team-a/tiny" in out.message
    assert "spotrl ckpt delete s3://bkt/spotrl/team-a/tiny --job team-a/tiny" in out.message
    kept = retention.gave_up(_deleted_job("Retain"), settings, "2 pod(s) of the job had not exited")
    assert (kept.reason, "retentionPolicy Retain") == ("CutsRetained", kept.message.split("; ")[1].split(":")[0])


def test_the_deletion_pods_add_up_to_an_outcome() -> None:
    ref = resources.JobRef("tiny", "team-a", "u1")
    uri = "s3://bkt/spotrl/team-a/tiny"
    assert retention.outcome_of([], uri, ref) is None
    assert retention.outcome_of([("Failed", "x"), None], uri, ref) is None
    done = retention.outcome_of([("Failed", "x"), ("Succeeded", '{"deleted": 7}')], uri, ref)
    assert done is not None
    assert (done.reason, "7 objects" in done.message) == ("CutsDeleted", True)
    failed = retention.outcome_of([("Failed", "a"), ("Failed", "b"), ("Failed", "DeadlineExceeded")], uri, ref)
    assert failed is not None
    assert failed.reason == "CutsNotDeleted"
    assert "DeadlineExceeded" in failed.message


def test_a_namespace_being_deleted_is_told_by_the_api_servers_403() -> None:
    refused = (
        'pods "tiny-retention-0" is forbidden: '
        "unable to create new content in namespace team-a because it is being terminated"
    )
    assert retention.namespace_closing(refused)
    assert not retention.namespace_closing('pods "x" is forbidden: User "u" cannot create resource "pods"')


def test_a_deletion_pod_has_a_deadline() -> None:
    from spotrl_runtime.api import rljob as api

    spec = api.parse_spec(_deleted_job()["spec"])
    pod = resources.retention_pod(resources.JobRef("tiny", "team-a", "u1"), spec, Settings(), "s3://b/x", 0)
    assert pod["spec"]["activeDeadlineSeconds"] == resources.RETENTION_DEADLINE_SECONDS
