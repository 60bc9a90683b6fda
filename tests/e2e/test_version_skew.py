"""Version skew on the real API server, both ways: an older operator and today's controller bridge
under a newer CRD (what a ``helm rollback`` of the operator leaves: the CRD stays, the operator goes
back), and an older controller's bridge under today's operator (a running job's controller keeps
its runtime image until its pod is made again).

The older operator and controller are those of :data:`PREVIOUS_RELEASE`, run from a checkout of that commit.
The newer CRD is today's with fields no version of SpotRL has yet, defaulted into every stored
RLJob as a real next CRD would: a spec section, a training knob, a status object, and a field
inside ``status.barrier`` (which a newer operator would write with every request)."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_harness import (
    CRD,
    NOWHERE,
    Jobs,
    JobStorage,
    OperatorProcess,
    apply_crd,
    condition_of,
    tiny_job,
    token_kubeconfig,
    wait_until,
)

from spotrl_e2e.cluster import Cluster
from spotrl_e2e.procs import Process
from spotrl_runtime.api.times import Deadline
from spotrl_runtime.controller.control import CutInfo

pytestmark = pytest.mark.cluster

PREVIOUS_RELEASE = "02aa473610d54a8f01946bf2343aaab9fc49b480"
"""The oldest operator a rollback may go back to: the commit whose operator this test runs (the first
that reads stored RLJobs leniently; dda6f73's operator, before it, stalls every job of a newer
CRD). Its controller is the oldest a newer operator must still serve. Move it forward to the last
commit before a change to what the operator or the controller reads or writes."""
REPO = Path(__file__).resolve().parents[2]
PREVIOUS_BRIDGE = Path(__file__).with_name("previous_bridge.py")


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkout of :data:`PREVIOUS_RELEASE`'s ``operator/`` and ``runtime/`` (``git archive``)."""
    out = tmp_path_factory.mktemp("previous-release")
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", PREVIOUS_RELEASE, "operator", "runtime"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return out


PREVIOUS_IMAGE = f"spotrl-runtime-cpu:{PREVIOUS_RELEASE[:12]}"
"""The previous release's runtime image: on the test control plane its pods run that release's
``runtime/`` (the node agent's ``image_sources``), as its image would."""


@pytest.fixture
def previous_image(cluster: Cluster, previous_release: Path) -> str:
    tag = cluster.image_sources / PREVIOUS_IMAGE.rsplit(":", 1)[1]
    tag.parent.mkdir(exist_ok=True)
    if not tag.exists():
        tag.symlink_to(previous_release)
    return PREVIOUS_IMAGE


def newer_crd(tmp: Path) -> Path:
    crd = yaml.safe_load(CRD.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    spec, status = schema["spec"]["properties"], schema["status"]["properties"]
    spec["training"]["properties"]["miniBatches"] = {"type": "integer", "default": 1}
    spec["sampling"] = {
        "type": "object",
        "default": {"dynamic": "off"},
        "properties": {"dynamic": {"type": "string"}},
    }
    status["barrier"]["properties"]["priority"] = {"type": "string", "default": "normal"}
    status["episodes"] = {"type": "object", "properties": {"turnsResumed": {"type": "integer"}}}
    out = tmp / "newer-crd.yaml"
    out.write_text(yaml.safe_dump(crd))
    return out


class HeldCut:
    """A Controllable whose barrier cut commits at once, once asked."""

    def __init__(self) -> None:
        self.asked = threading.Event()

    def request_barrier(self, reason: str, deadline: Deadline) -> CutInfo:
        self.asked.set()
        return CutInfo("0000000009", 9, "s3://bucket-x/tiny/cuts/0000000009", "barrier", time.time(), 0.1)


def test_after_a_rollback_the_older_operator_runs_a_job_of_a_newer_crd_through_a_barrier_and_its_deletion(
    cluster: Cluster,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    jobs: Jobs,
    tmp_path: Path,
    previous_release: Path,
) -> None:
    from test_operator import runtime_bridge

    cluster.install_crd(newer_crd(tmp_path))
    try:
        op = start_operator(source=previous_release)
        created = jobs.create(
            tiny_job("tiny", checkpoint={"storage": "s3://bucket-x/tiny"}, scheduling={"nodeSelector": NOWHERE})
        )
        assert created["spec"]["sampling"] == {"dynamic": "off"}, "the API server defaulted the new fields"
        assert created["spec"]["training"]["miniBatches"] == 1
        jobs.wait("tiny", lambda s: s.get("attempt") == 1, 20, "the first attempt")
        jobs.patch_status("tiny", {"episodes": {"turnsResumed": 2}})  # a newer controller's status

        def skew() -> dict | None:
            return condition_of(jobs, "tiny", "VersionSkew")

        def status_skipped() -> bool:
            return op.metrics().get('spotrl_operator_skipped_fields_total{part="status"}', 0) >= 1

        wait_until(lambda: skew() is not None and status_skipped(), 20, "VersionSkew, and the status field skipped")
        # That operator names the first 10 fields it skipped (spec first) and counts the rest: the
        # fields today's CRD defaults into every job and it does not know come before the status one.
        message = (skew() or {})["message"]
        named = [f for f in ("spec.sampling", "spec.training.miniBatches", "status.episodes") if f in message]
        more = re.search(r" and (\d+) more;", message)
        assert message.startswith("this operator skipped fields it does not know: spec."), message
        assert len(named) == 3 or (more is not None and int(more.group(1)) >= 3 - len(named)), message
        assert "VersionSkew" in jobs.said("tiny", {"VersionSkew"})
        assert op.metrics().get('spotrl_operator_skipped_fields_total{part="spec"}', 0) >= 1

        held = HeldCut()
        bridge = runtime_bridge(cluster, namespace, "tiny", 1, tmp_path).start(held)
        try:
            jobs.patch_spec("tiny", {"suspend": True})
            assert held.asked.wait(20), "the controller's bridge never answered a barrier carrying a newer field"
            st = jobs.wait("tiny", lambda s: s.get("phase") == "Suspended", 30, "the suspend after the barrier")
            assert st["barrier"]["priority"] == "normal", "the request carried the newer field"
            assert st["barrier"]["state"] == "Committed"
            assert st["lastCut"]["id"] == "0000000009"
        finally:
            bridge.stop()
        jobs.delete("tiny", timeout=30)
        assert jobs.get("tiny") is None, "the finalizer let the job go"
        assert op.running()
    finally:
        apply_crd(cluster)


def test_a_crd_field_this_operator_cannot_read_is_said_on_the_job_not_only_logged(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess], jobs: Jobs, tmp_path: Path
) -> None:
    """A value, not a key, this version does not know (a newer CRD widened an enum): no guess, and
    the job says why it is not handled; deleting it still ends within the finalizer's deadline."""
    crd = yaml.safe_load(CRD.read_text())
    wider = copy.deepcopy(crd)
    checkpoint = wider["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "checkpoint"
    ]["properties"]
    checkpoint["retentionPolicy"]["enum"] = [*checkpoint["retentionPolicy"]["enum"], "Archive"]
    path = tmp_path / "wider-crd.yaml"
    path.write_text(yaml.safe_dump(wider))
    cluster.install_crd(path)
    try:
        start_operator(args=("--finalizer-seconds", "5"))
        jobs.create(tiny_job("odd", checkpoint={"storage": "s3://bucket-x/odd", "retentionPolicy": "Archive"}))

        def stuck() -> dict | None:
            return condition_of(jobs, "odd", "ReconcileError")

        wait_until(lambda: "retentionPolicy" in ((stuck() or {}).get("message") or ""), 30, "a condition naming it")
        assert (stuck() or {})["reason"] == "SpecNotUnderstood"

        # Its passes keep their backoff (the job's failureBudget: 10 s, doubling): the condition
        # they write is an event on the job, which must not wake it for another pass at once.
        # (The job's first events, Kopf's and ours, each rightly run one.)
        def tries() -> int:
            return int(re.search(r"failed (\d+) time", (stuck() or {})["message"]).group(1))  # type: ignore[union-attr]

        time.sleep(1)
        before = tries()
        time.sleep(4)
        assert tries() - before <= 1, f"{tries() - before} more passes in 4 s: the job's own condition woke it"
        jobs.delete("odd", timeout=40)
        assert jobs.get("odd") is None
    finally:
        apply_crd(cluster)


def test_an_older_controller_under_a_newer_operator_commits_its_barrier(
    cluster: Cluster,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    jobs: Jobs,
    tmp_path: Path,
    previous_release: Path,
) -> None:
    """The other way round: today's operator asks a barrier of a controller that still runs the
    previous release's bridge (its own process, from the checkout), and each request carries a
    field that bridge does not know (the newer CRD defaults ``status.barrier.priority`` into it,
    as a newer operator would write it). The old bridge's cut is the one the job suspends on."""
    cluster.install_crd(newer_crd(tmp_path))
    try:
        start_operator()
        jobs.create(
            tiny_job("tiny", checkpoint={"storage": "s3://bucket-x/tiny"}, scheduling={"nodeSelector": NOWHERE})
        )
        jobs.wait("tiny", lambda s: s.get("attempt") == 1, 20, "the first attempt")
        kubeconfig = token_kubeconfig(cluster, namespace, "tiny-runtime", tmp_path / "tiny-runtime.kubeconfig")
        old = Process(
            "previous-bridge",
            [sys.executable, PREVIOUS_BRIDGE, kubeconfig, namespace, "tiny", 1, "0000000007"],
            tmp_path,
            env={**os.environ, "PYTHONPATH": str(previous_release / "runtime")},
        ).start()
        try:

            def said(line: str) -> bool:
                return line in old.log.read_text(errors="replace")

            old.wait_ready(lambda: said("bridge "), 20, "watching its RLJob")
            assert said(f"bridge {previous_release / 'runtime'}"), "the bridge that runs is the previous release's"
            jobs.patch_spec("tiny", {"suspend": True})
            old.wait_ready(lambda: said("asked suspend"), 20, "asked for a barrier carrying a field it does not know")
            st = jobs.wait("tiny", lambda s: s.get("phase") == "Suspended", 30, "the suspend after the barrier")
            assert st["barrier"]["priority"] == "normal", "the request carried the newer field"
            assert st["barrier"]["state"] == "Committed"
            assert st["barrier"]["cutId"] == st["lastCut"]["id"] == "0000000007", "the old bridge's cut"
        finally:
            old.stop()
    finally:
        apply_crd(cluster)


def test_a_previous_release_controller_commits_the_barrier_todays_operator_asks_and_today_resumes_its_cut(
    cluster: Cluster,
    jobs: Jobs,
    start_operator: Callable[..., OperatorProcess],
    e2e_storage: JobStorage,
    reference: dict[int, Any],
    previous_release: Path,
    previous_image: str,
) -> None:
    """A running job's controller keeps its image until its pod is made again. The previous
    release's operator starts the tiny job on the previous release's image; today's operator
    takes over (a rolling update: the old one stops first); a spot notice and a drain then reach
    the old controller, which commits the barrier cut today's operator asks for. Today's
    controller, on today's image, resumes from that cut, and the job trains the stream of a job
    never preempted: the whole skew, training and the cut's format included, not a stand-in."""
    from test_preemption import AWS_NOTICE, SPOT, assert_same_stream, start, succeeded, training

    old = start_operator(source=previous_release, args=("--runtime-image", previous_image))
    start(cluster, jobs, e2e_storage, "tiny", SPOT)
    st = training(jobs, "tiny", 3)
    node, pod = st["controllerNode"], st["controllerPod"]
    assert image_of(cluster, jobs.ns, pod) == previous_image
    events = cluster.admin().get(f"/api/v1/namespaces/{jobs.ns}/events", fieldSelector=f"involvedObject.name={pod}")
    tag = previous_image.rsplit(":", 1)[1]
    assert any(f"the code of release {tag}" in e.get("message", "") for e in events["items"]), (
        "the controller that trains is the previous release's"
    )
    old.stop()
    start_operator()

    cluster.taint(node, AWS_NOTICE, "true")
    drain = cluster.drain(node, timeout=300)
    try:
        cut, _ = jobs.barrier_commit("tiny", 120)
        assert drain.wait(300) == 0, drain.output()
    finally:
        drain.stop()
    st = succeeded(jobs, "tiny")
    assert (st["attempt"], st["preemptions"], st["restarts"]) == (2, 1, 0), st
    assert image_of(cluster, jobs.ns, st["controllerPod"]) != previous_image, "the new pod runs today's image"
    assert f"resumed from cut {cut}" in cluster.pod_log(jobs.ns, st["controllerPod"])
    assert_same_stream(reference, e2e_storage, "tiny")


def image_of(cluster: Cluster, namespace: str, pod: str) -> str:
    spec = cluster.admin().get(f"/api/v1/namespaces/{namespace}/pods/{pod}")["spec"]
    (controller,) = [c for c in spec["containers"] if c["name"] == "controller"]
    return str(controller["image"])
