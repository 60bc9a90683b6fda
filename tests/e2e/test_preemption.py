"""End to end: the tiny example RLJob trains with the real `spotrl controller`, its node goes
away in each of the ways spot nodes go, and the job still succeeds with the same effective
prompt stream (``spotrl audit``) as the same job never preempted.

Runs on the test control plane (the operator as a subprocess with the chart's identity) or,
with ``SPOTRL_E2E_TARGET=kind`` (``make e2e-kind``), on a kind cluster with the chart
installed. Real parts only: API server, controllers, node agent or kubelet, S3 server,
operator, controller.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_harness import TARGET, Jobs, JobStorage, wait_until

from spotrl_runtime.vllm_build import vllm_build

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny-cpu.yaml"
STEPS = 12
SPOT = {"karpenter.sh/capacity-type": "spot"}
ON_DEMAND = {"karpenter.sh/capacity-type": "on-demand"}
TRAIN_TIMEOUT = 900
AWS_NOTICE = "aws-node-termination-handler/spot-itn"
KARPENTER = "karpenter.sh/disrupted"
VLLM = {"backend": "vllm", "kvCacheMemory": "64Mi"}
"""spec.generation for vLLM's CPU build (the production engine): on the test control plane the
pods run with this checkout's environment, on kind the runtime-cpu image carries it. The prompt
stream does not depend on the engine, so the run's reference (transformers) is theirs too."""
VLLM_CPU = vllm_build() != "cuda" and platform.machine() == "x86_64"
"""vLLM's CPU build belongs here (x86-64 without the CUDA build): the drain test generates with it."""
needs_vllm_cpu = pytest.mark.skipif(
    TARGET == "kind" or vllm_build() == "cuda" or platform.machine() != "x86_64",
    # Not skipped where the CPU build is missing but belongs: the worker's install message fails the job.
    reason="vLLM's CPU build runs on x86-64 without its CUDA build, and not in the runtime-cpu image (kind)",
)


on_the_test_control_plane = pytest.mark.skipif(
    TARGET == "kind",
    reason="runs the operator as a test process on the test control plane (with failpoints or API-only Nodes) and "
    "its S3 server; the local suite runs it, and kind's pods cannot reach that server",
)


def runtime_commands() -> str:
    out = subprocess.run([sys.executable, "-m", "spotrl_runtime.cli", "--help"], capture_output=True, text=True)
    return out.stdout


@pytest.fixture(scope="module", autouse=True)
def _needs_the_real_controller() -> None:
    """These tests run the real `spotrl controller` (and `spotrl run`, `spotrl audit`); they
    fail, loudly, where the runtime does not have them."""
    missing = [c for c in ("controller", "run", "audit") if f" {c} " not in runtime_commands()]
    if missing:
        pytest.fail(f"the runtime lacks `spotrl {'`, `spotrl '.join(missing)}`: the end-to-end tests need them")


def tiny_job(
    name: str,
    storage: JobStorage,
    node_selector: dict[str, str],
    generation: dict[str, Any] | None = None,
    checkpoint: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """examples/tiny-cpu.yaml, shortened, with its cuts in the test's bucket (``generation``,
    ``checkpoint``: changes to spec.generation and spec.checkpoint)."""
    job = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    job["metadata"] = {"name": name}
    spec = job["spec"]
    spec["training"]["totalSteps"] = STEPS
    spec["checkpoint"].update(
        {
            "storage": storage.uri(name),
            "s3Endpoint": storage.pod_endpoint,
            "credentialsSecret": "s3",
            "everySteps": 3,
            **(checkpoint or {}),
        }
    )
    spec["scheduling"]["nodeSelector"] = node_selector
    spec["generation"].update(generation or {})
    return job


def effective_stream(storage: JobStorage, name: str) -> dict[int, list[int]]:
    """`spotrl audit` of the job's storage, as a user runs it: for each trained step, the
    prompts of its last record (the effective stream)."""
    return {int(d["step"]): list(d["prompts"]) for d in audit(storage, name)}


def audit(storage: JobStorage, name: str, *flags: str) -> list[dict[str, Any]]:
    """The JSON lines `spotrl audit URI [flags]` prints."""
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": storage.access_key,
        "AWS_SECRET_ACCESS_KEY": storage.secret_key,
        "AWS_DEFAULT_REGION": storage.region,
    }
    argv = [sys.executable, "-m", "spotrl_runtime.cli", "audit", storage.uri(name)]
    out = subprocess.run(
        [*argv, "--endpoint", storage.host_endpoint, *flags],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, f"spotrl audit {storage.uri(name)} failed:\n{out.stdout}{out.stderr}"
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def start(
    cluster: Any,
    jobs: Jobs,
    storage: JobStorage,
    name: str,
    nodes: dict[str, str],
    generation: dict[str, Any] | None = None,
    checkpoint: dict[str, Any] | None = None,
) -> None:
    if cluster.admin().get_or_none(f"/api/v1/namespaces/{jobs.ns}/secrets/s3") is None:
        cluster.admin().create(f"/api/v1/namespaces/{jobs.ns}/secrets", storage.secret())
    jobs.create(tiny_job(name, storage, nodes, generation, checkpoint))


def storage_refused(status: dict[str, Any]) -> bool:
    """The job's controller refused its storage (a cut it cannot read): it waits for a new spec."""
    return any(c["type"] == "StorageRefused" and c["status"] == "True" for c in status.get("conditions") or [])


def ended(status: dict[str, Any]) -> bool:
    """Succeeded, Failed, or waiting for a new spec after a refused storage."""
    return status.get("phase") in ("Succeeded", "Failed") or storage_refused(status)


def succeeded(jobs: Jobs, name: str) -> dict[str, Any]:
    """Waits for the job to end (a refused storage fails at once, not at the timeout)."""
    st = jobs.wait(name, ended, TRAIN_TIMEOUT, f"{name} to finish")
    assert st["phase"] == "Succeeded", json.dumps(st, indent=1)
    assert st["step"] == STEPS
    return st


def start_operator_holding(start_operator: Any, tmp_path: Path, failpoints: str) -> Path:
    """The operator, its controllers started with ``SPOTRL_FAILPOINTS=failpoints`` (through
    ``--runtime-env``): returns the folder where a controller marks its arrival at a point, and
    where the test creates ``<point>.release`` to let it go on (spotrl_runtime.failpoints)."""
    held = tmp_path / "failpoints"
    held.mkdir()
    held.chmod(0o777)  # the pods' user writes its marks here
    start_operator(
        args=("--runtime-env", f"SPOTRL_FAILPOINTS={failpoints}", "--runtime-env", f"SPOTRL_FAILPOINT_DIR={held}")
    )
    return held


def training(jobs: Jobs, name: str, min_step: int, attempt: int | None = 1) -> dict[str, Any]:
    """Waits until attempt ``attempt`` (None: the current one, whichever) has trained ``min_step`` steps."""
    return jobs.wait(
        name,
        lambda s: (
            s.get("stepAttempt") == (s.get("attempt") if attempt is None else attempt)
            and (s.get("step") or 0) >= min_step
        ),
        TRAIN_TIMEOUT,
        f"{name} attempt {attempt or 'now current'} to train {min_step} steps",
    )


def run_reference(storage: JobStorage, folder: Path) -> dict[int, Any]:
    """The effective stream of the same job never preempted: `spotrl run` of the same spec
    (its cuts and audit in ``storage``; the ``reference`` fixture runs it once per run)."""
    job = tiny_job("reference", storage, ON_DEMAND)
    job["spec"]["checkpoint"]["s3Endpoint"] = storage.host_endpoint
    file = folder / "reference.yaml"
    file.write_text(yaml.safe_dump(job))
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": storage.access_key,
        "AWS_SECRET_ACCESS_KEY": storage.secret_key,
        "AWS_DEFAULT_REGION": storage.region,
        "AWS_ENDPOINT_URL": storage.host_endpoint,
    }
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "spotrl_runtime.cli",
            "run",
            "-f",
            str(file),
            "--storage",
            storage.uri("reference"),
            "-q",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=TRAIN_TIMEOUT,
        check=False,
        cwd=file.parent,
    )
    assert out.returncode == 0, f"spotrl run of the reference job failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
    stream = effective_stream(storage, "reference")
    assert len(stream) == STEPS, sorted(stream)
    return stream


def assert_same_stream(reference: dict[int, Any], storage: JobStorage, name: str) -> None:
    got = effective_stream(storage, name)
    assert sorted(got) == list(range(STEPS)), f"steps trained: {sorted(got)}"
    assert_tensorboard_shows_each_step_once(storage, name)
    if got != reference:
        differ = [step for step in sorted(got) if got[step] != reference.get(step)]
        records = "\n".join(
            f"  step {d['step']} attempt {d['attempt']}: {d['prompts']}" for d in audit(storage, name, "--all")
        )
        pytest.fail(
            f"the preempted job trained other prompts than the job never preempted at steps {differ}\n"
            f"reference: {[reference[s] for s in differ]}\nevery record of the preempted job:\n{records}"
        )


def assert_tensorboard_shows_each_step_once(storage: JobStorage, name: str) -> None:
    """The job's TensorBoard files on S3 (one per controller attempt, put again after each
    step), read with TensorBoard's own reader: every step once, the preempted attempts' and
    the resumed ones' together."""
    import tempfile

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    keys = storage.keys(f"{name}/tensorboard/")
    assert keys, f"no TensorBoard files under {storage.uri(name)}/tensorboard/"
    with tempfile.TemporaryDirectory() as folder:
        for key in keys:
            storage.client().download_file(storage.bucket, key, str(Path(folder) / key.rsplit("/", 1)[-1]))
        events = EventAccumulator(folder)
        events.Reload()
        steps = [e.step for e in events.Scalars("reward/mean")]
    assert steps == list(range(STEPS)), f"TensorBoard's steps ({len(keys)} files): {steps}"


def assert_enforces_restricted(cluster: Any, namespace: str) -> None:
    """The job's namespace refuses a pod that Pod Security ``restricted`` does not allow, so
    every pod the operator makes there (controllers, workers, deletion pods) passed it."""
    bare = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "not-restricted"},
        "spec": {"containers": [{"name": "c", "image": "busybox", "command": ["true"]}]},
    }
    r = cluster.kubectl("create", "-n", namespace, "-f", "-", input=yaml.safe_dump(bare), check=False)
    assert r.returncode != 0, "the namespace admitted a pod that is not restricted"
    assert 'violates PodSecurity "restricted' in r.stderr, r.stderr


def assert_stopped_after(cluster: Any, ns: str, pod: str, committed_at: str) -> None:
    """``pod`` got a Killing event, and none before the barrier cut committed (to the second)."""
    killed = [
        e.get("lastTimestamp") or e.get("eventTime") or ""
        for e in cluster.admin().get(
            f"/api/v1/namespaces/{ns}/events", fieldSelector=f"involvedObject.name={pod},reason=Killing"
        )["items"]
    ]
    assert killed, f"no Killing event for {pod}"
    assert min(killed)[:19] >= committed_at[:19], (
        f"{pod} was stopped at {min(killed)}, the cut committed at {committed_at}"
    )


def other_node(jobs: Jobs, name: str, than: str, attempt: int = 2) -> str:
    st = training(jobs, name, 1, attempt=attempt)
    assert st["attempt"] == attempt
    assert st["controllerNode"] != than, f"the fresh controller landed on the node that went away ({than})"
    return str(st["controllerNode"])


@pytest.mark.kind_ci
def test_a_drain_after_a_notice_waits_for_the_barrier_cut_then_resumes_elsewhere(
    e2e_cluster: Any, e2e_jobs: Jobs, e2e_storage: JobStorage, reference: dict[int, Any]
) -> None:
    """The AWS termination handler's taint, then a drain, with vLLM's CPU build generating (the
    kind subset's vLLM job: the runtime-cpu image's engine on a real kubelet). Karpenter's taint
    (``karpenter.sh/disrupted``) then a drain is the standby test's preemption below, with the
    same assertions on the notice, the refused eviction and the stop after the commit (and
    Karpenter's taint is the notice of the unusable-nodes and double-preemption tests too).
    The barrier cut is a delta (``checkpoint.barrier: delta``) on the periodic cut of step 3:
    the next controller redoes the steps after it from their rows, and says so."""
    jobs = e2e_jobs
    taint = AWS_NOTICE
    assert_enforces_restricted(e2e_cluster, jobs.ns)
    start(e2e_cluster, jobs, e2e_storage, "tiny", SPOT, VLLM if VLLM_CPU else None, {"barrier": "delta"})
    training(jobs, "tiny", 4)
    st = jobs.wait("tiny", lambda s: ((s.get("lastCut") or {}).get("step") or 0) >= 3, 120, "the full cut of step 3")
    node, pod = st["controllerNode"], st["controllerPod"]
    if VLLM_CPU:
        assert "(vllm backend" in e2e_cluster.pod_log(jobs.ns, pod), "the controller's worker is not vLLM's"

    e2e_cluster.taint(node, taint, "true")
    code, message = e2e_cluster.evict(jobs.ns, pod)
    barrier = jobs.status("tiny").get("barrier") or {}
    assert code == 429, f"an eviction went through before the cut committed: {code} {message}"
    assert barrier.get("state") != "Committed" or code == 429

    drain = e2e_cluster.drain(node, timeout=300)
    try:
        cut, committed_at = jobs.barrier_commit("tiny", 120)
        assert int(jobs.status("tiny")["lastCut"]["id"]) >= int(cut)
        # Read now: retention (keep 3) deletes it before the run ends.
        key = f"tiny/cuts/{cut}/manifest.json"
        manifest = json.loads(e2e_storage.client().get_object(Bucket=e2e_storage.bucket, Key=key)["Body"].read())
        assert drain.wait(300) == 0, drain.output()
    finally:
        drain.stop()
    # The old controller was stopped (evicted, or deleted by the operator) only after the commit.
    assert_stopped_after(e2e_cluster, jobs.ns, pod, committed_at)
    other_node(jobs, "tiny", node)

    st = succeeded(jobs, "tiny")
    assert (st["preemptions"], st["restarts"]) == (1, 0)
    assert st["secondsLost"] > 0
    reasons = jobs.said("tiny", {"PreemptionNotice", "BarrierCommitted", "Resumed"})
    assert "BarrierMissed" not in reasons
    assert_recovery_measured(jobs, st)
    rec = st["lastRecovery"]
    assert rec["cutForm"] == "delta", rec
    assert manifest["form"] == "delta", manifest
    # The steps redone are those between the delta's base and the delta (none when the notice
    # came right after a periodic full cut: kind once took its barrier at step 6, on one).
    assert rec["stepsRedone"] == manifest["trainer_step"] - manifest["base"]["trainer_step"], (rec, manifest)
    assert st["accounting"]["stepsRedone"] == rec["stepsRedone"], st["accounting"]
    (said,) = [e for e in jobs.events("tiny") if e["reason"] == "Recovered"]
    assert f"from a delta cut: {rec['stepsRedone']} step(s) redone" in said["message"], said["message"]
    assert_same_stream(reference, e2e_storage, "tiny")


@on_the_test_control_plane
def test_the_disruption_budget_holds_the_controller_until_its_barrier_cut_commits(
    cluster: Any, jobs: Jobs, start_operator: Any, e2e_storage: JobStorage, tmp_path: Path
) -> None:
    """The operator opens the controller's PodDisruptionBudget only once the barrier cut has
    committed, not when it asks for it: with the cut held after its capture (failpoint
    ``cut.captured``) every eviction is refused (429) though the barrier is under way, and the
    first one let through comes after the commit, with the budget opened. The drain test's 429
    comes before any barrier is asked for (the budget's default), so it cannot tell a budget
    opened at the request (a drain evicting mid-cut) from one opened at the commit."""
    held = start_operator_holding(start_operator, tmp_path, "cut.captured=120")
    start(cluster, jobs, e2e_storage, "tiny", SPOT, checkpoint={"barrierDeadlineSeconds": 90})
    st = training(jobs, "tiny", 2)
    node, pod = st["controllerNode"], st["controllerPod"]
    budget = f"/apis/policy/v1/namespaces/{jobs.ns}/poddisruptionbudgets/tiny-controller"

    cluster.taint(node, KARPENTER, "true")
    wait_until((held / "cut.captured").exists, 120, "the barrier cut, held after its capture")
    for _ in range(3):  # a drain's retries while the cut is being written
        code, message = cluster.evict(jobs.ns, pod)
        assert code == 429, f"the controller was evicted in the middle of its barrier cut: {code} {message}"
        assert "disruption budget" in message, message
    barrier = jobs.status("tiny")["barrier"]
    assert barrier["state"] == "Requested", barrier
    pdb = cluster.admin().get(budget)
    assert (pdb["spec"]["minAvailable"], pdb["status"]["disruptionsAllowed"]) == (1, 0), pdb
    since = pdb["metadata"]["resourceVersion"]

    (held / "cut.captured.release").touch()
    refused = 0
    while (answer := cluster.evict(jobs.ns, pod))[0] == 429:
        refused += 1
        assert refused < 300, "the eviction was still refused a minute after the cut was let go"
        time.sleep(0.2)
    allowed_at = datetime.now().astimezone()
    # 201: evicted; 404: the operator deleted the pod first (it does, once the cut committed).
    assert answer[0] in (201, 404), answer
    cut, committed_at = jobs.barrier_commit("tiny", 60)
    assert datetime.fromisoformat(committed_at) <= allowed_at, (committed_at, allowed_at, answer)
    # The budget itself opened (minAvailable 0) after the hold: not only the pod's deletion.
    changes = cluster.admin().watch(
        f"/apis/policy/v1/namespaces/{jobs.ns}/poddisruptionbudgets",
        since,
        timeout_seconds=3,
        fieldSelector="metadata.name=tiny-controller",
    )
    seen = [e["object"]["spec"].get("minAvailable") for e in changes if e["type"] == "MODIFIED"]
    assert 0 in seen, f"the budget never opened; minAvailable after the hold: {seen}"

    other_node(jobs, "tiny", node)
    resumed = resumed_cut(jobs, e2e_storage, "tiny")
    assert (resumed["cut_id"], resumed["kind"]) == (cut, "barrier"), resumed
    # To the end: the held cut lost nothing (and no controller writes to the bucket afterwards).
    st = succeeded(jobs, "tiny")
    assert (st["preemptions"], st["restarts"]) == (1, 0)
    assert_resumed_from(cluster, jobs, e2e_storage, "tiny", st, resumed)


@needs_vllm_cpu
@on_the_test_control_plane
def test_with_a_standby_the_warm_pod_takes_over_after_the_barrier_cut(
    cluster: Any,
    jobs: Jobs,
    start_operator: Any,
    e2e_storage: JobStorage,
    reference: dict[int, Any],
    tmp_path: Path,
) -> None:
    """spec.standby: the next attempt's controller pod waits warm on the other spot node, is
    not counted by the PodDisruptionBudget (an eviction of the controller is still refused),
    and is the pod that takes over: the same pod, not a new one, with the same prompts trained.
    The job generates with vLLM: the notice, the barrier cut with the engine in the loop, and
    the standby's engine, started while it waits. The tiny job trains its 12 steps faster than a
    standby warms up on 2 cores: step 3 is held (a failpoint) until the standby is warm. (On kind
    it would be skipped anyway: it holds a step through the operator's --runtime-env, and the
    kind operator is the chart's.)"""
    held = start_operator_holding(start_operator, tmp_path, "train.step@3=300")
    job = tiny_job("tiny", e2e_storage, SPOT)
    job["spec"]["standby"] = True
    job["spec"]["generation"].update(VLLM)
    cluster.admin().create(f"/api/v1/namespaces/{jobs.ns}/secrets", e2e_storage.secret())
    jobs.create(job)
    st = training(jobs, "tiny", 1)
    node, pod = st["controllerNode"], st["controllerPod"]

    def standby() -> dict[str, Any] | None:
        pods = [p for p in jobs.pods("tiny") if p["metadata"]["name"] == "tiny-controller-2"]
        return pods[0] if pods else None

    wait_until(lambda: (standby() or {}).get("status", {}).get("phase") == "Running", 120, "the standby to run")
    waiting = standby()
    assert waiting is not None
    assert waiting["metadata"]["labels"].get("spotrl.dev/standby") == "true"
    assert waiting["spec"]["nodeName"] != node, "the standby shares the controller's node"
    wait_until(
        lambda: "waiting for status.attempt to reach 2" in cluster.pod_log(jobs.ns, "tiny-controller-2"),
        300,
        "the standby to be warm",
    )
    wait_until((held / "train.step").exists, 60, "step 3 to be held")
    assert "(vllm backend" in cluster.pod_log(jobs.ns, pod), "the first controller's worker is not vLLM's"
    assert "(vllm backend" in cluster.pod_log(jobs.ns, "tiny-controller-2"), "the standby did not warm vLLM"
    st = jobs.status("tiny")
    assert (st["attempt"], st["controllerPod"], st.get("standbyPod")) == (1, pod, "tiny-controller-2")
    wide = cluster.kubectl("get", "rljobs", "-n", jobs.ns, "-o", "wide").stdout
    assert "STANDBY" in wide.splitlines()[0], wide
    assert "tiny-controller-2" in wide.splitlines()[1], wide
    # The standby holds nothing: the budget still holds the controller alone.
    code, message = cluster.evict(jobs.ns, pod)
    assert code == 429, f"the controller was evicted with a standby running: {code} {message}"

    cluster.taint(node, KARPENTER, "true")
    drain = cluster.drain(node, timeout=300)
    (held / "train.step.release").touch()  # the barrier interrupts the held step
    try:
        _, committed_at = jobs.barrier_commit("tiny", 120)
        assert drain.wait(300) == 0, drain.output()
    finally:
        drain.stop()
    assert_stopped_after(cluster, jobs.ns, pod, committed_at)
    st = training(jobs, "tiny", 1, attempt=2)
    took_over = standby()
    assert took_over is not None
    assert took_over["metadata"]["uid"] == waiting["metadata"]["uid"], "a new pod was made instead"
    assert st["controllerPod"] == "tiny-controller-2"
    assert st["controllerNode"] == waiting["spec"]["nodeName"]
    wait_until(
        lambda: "spotrl.dev/standby" not in ((standby() or {}).get("metadata", {}).get("labels") or {}),
        30,
        "the operator to take the standby label off",
    )
    cluster.untaint(node, KARPENTER)
    cluster.uncordon(node)

    st = succeeded(jobs, "tiny")
    assert (st["preemptions"], st["restarts"]) == (1, 0)
    rec = st["lastRecovery"]
    assert (rec["attempt"], rec["kind"], rec["standby"]) == (2, "barrier", True), rec
    assert "scheduledAt" not in rec, rec
    assert "scheduledToStarted" not in rec["phases"], rec
    said = {"PreemptionNotice", "StandbyCreated", "StandbyPromoted", "BarrierCommitted", "Recovered"}
    reasons = jobs.said("tiny", said)
    assert "StandbyFailed" not in reasons
    assert_same_stream(reference, e2e_storage, "tiny")
    # Done: no standby is kept for a job that has nothing left to train.
    wait_until(
        lambda: not [p for p in jobs.pods("tiny") if p["metadata"]["labels"].get("spotrl.dev/standby") == "true"],
        60,
        "the last standby to go",
    )


RECOVERY_PHASES = (
    "noticeToRequested",
    "requestedToCommitted",
    "committedToDeleted",
    "deletedToScheduled",
    "scheduledToStarted",
    "startedToRestored",
    "restoredToReady",
    "readyToFirstStep",
)


def assert_recovery_measured(jobs: Jobs, st: dict[str, Any]) -> None:
    """A barrier recovery is on the status phase by phase, every phase measured, in order,
    and said in one Recovered Event; the accounting lost and retrained nothing."""
    rec = st["lastRecovery"]
    assert rec["attempt"] == 2, rec
    assert rec["kind"] == "barrier", rec
    phases = rec["phases"]
    assert [p for p in RECOVERY_PHASES if p not in phases] == [], rec
    assert all(phases[p] >= 0 for p in RECOVERY_PHASES), rec
    marks = [rec[k] for k in ("requestedAt", "committedAt", "podDeletedAt", "startedAt", "readyAt", "firstStepAt")]
    assert marks == sorted(marks), rec
    # The phases follow each other: they add up to the total (the pod's PodScheduled time has
    # second precision, and a phase that would come out negative by it counts 0).
    assert rec["totalSeconds"] > 0, rec
    assert abs(sum(phases[p] for p in RECOVERY_PHASES) - rec["totalSeconds"]) <= 1.1, rec
    print("lastRecovery:", ", ".join(f"{p} {phases[p]:.2f}s" for p in RECOVERY_PHASES), f"total {rec['totalSeconds']}")
    (said,) = [e for e in jobs.events("tiny") if e["reason"] == "Recovered"]
    assert f"total {rec['totalSeconds']:.1f}s" in said["message"], said["message"]
    assert_accounted(st, retrained=0)


def assert_accounted(st: dict[str, Any], retrained: int) -> None:
    """The run's accounting (``status.accounting``, from its audit and restore records): every
    prompt trained once, ``retrained`` steps trained again, and one attempt that resumed from
    a cut. A controller that ignored the cut and started again at step 0 retrains every step
    the preempted one trained, and restores nothing."""
    acc = st["accounting"]
    assert (acc["promptsLost"], acc["promptsTrainedTwice"], acc["stepsMissing"]) == (0, 0, 0), acc
    assert acc["stepsRetrained"] == retrained, (acc, f"{retrained} step(s) to train again")
    assert acc["restores"] == 1, acc
    assert acc["promptsTrained"] > 0, acc


def cut_manifests(storage: JobStorage, name: str) -> dict[str, dict[str, Any]]:
    """The manifest of every cut of the job committed now, by cut id."""
    s3, found = storage.client(), {}
    for key in storage.keys(f"{name}/cuts/"):
        if key.endswith("/manifest.json"):
            try:
                body = s3.get_object(Bucket=storage.bucket, Key=key)["Body"].read()
            except s3.exceptions.NoSuchKey:
                continue  # retention took it meanwhile
            found[key.split("/")[-2]] = json.loads(body)
    return found


def resumed_cut(jobs: Jobs, storage: JobStorage, name: str, attempt: int = 2) -> dict[str, Any]:
    """The manifest of the cut that ``attempt`` (training now) resumed from, by its
    ``status.resume``; read at once, since retention deletes a cut a few cuts on. It must be
    the newest cut the attempts before it committed: the seeded loader yields the same stream
    to a controller that ignored every cut and trained from step 0, or took an older one, so
    the stream alone cannot tell."""
    resume = jobs.status(name).get("resume") or {}
    assert resume.get("attempt") == attempt, resume
    assert resume.get("cutId"), f"attempt {attempt} resumed from no cut: {resume}"
    cuts = cut_manifests(storage, name)
    shown = [(c, m["attempt"], m["kind"], m["trainer_step"]) for c, m in sorted(cuts.items())]
    older = [c for c, m in cuts.items() if m["attempt"] < attempt]
    assert older, f"no cut of an attempt before {attempt}: {shown}"
    assert resume["cutId"] == max(older, key=int), f"resumed from {resume['cutId']}; committed: {shown}"
    return cuts[resume["cutId"]]


def assert_resumed_from(
    cluster: Any, jobs: Jobs, storage: JobStorage, name: str, st: dict[str, Any], cut: dict[str, Any]
) -> None:
    """The finished run's own records agree that its last attempt started at ``cut`` (a
    manifest from :func:`resumed_cut`): its first audited step is the cut's step (not 0), its
    restore record and its log name the cut, and the accounting retrained exactly the steps the
    attempt before trained past the cut (none past a barrier cut, which holds them all)."""
    attempt = st["attempt"]
    cut_id, step = cut["cut_id"], cut["trainer_step"]
    records = audit(storage, name, "--all")
    first = min(d["step"] for d in records if d["attempt"] == attempt)
    assert first == step > 0, f"attempt {attempt} first trained step {first}; it resumed from cut {cut_id} at {step}"
    past = {d["step"] for d in records if d["attempt"] < attempt and d["step"] >= step}
    if cut["kind"] == "barrier":
        assert past == set(), f"the barrier cut at step {step}, yet steps {sorted(past)} were trained before it"
    assert_accounted(st, retrained=len(past))
    s3 = storage.client()
    restores = [
        json.loads(s3.get_object(Bucket=storage.bucket, Key=key)["Body"].read())
        for key in storage.keys(f"{name}/audit/restores/")
    ]
    assert [(r["attempt"], r["cut_id"], r["cut_step"]) for r in restores] == [(attempt, cut_id, step)], restores
    log = cluster.pod_log(jobs.ns, f"{name}-controller-{attempt}")
    assert f"attempt {attempt} resumes from cut {cut_id} (step {step})" in log, log[-3000:]


def test_a_disruption_target_eviction_resumes_elsewhere(
    e2e_cluster: Any, e2e_jobs: Jobs, e2e_storage: JobStorage, reference: dict[int, Any]
) -> None:
    """A NoExecute taint: the taint manager evicts the controller (DisruptionTarget,
    DeletionByTaintManager) without asking the PDB; the controller cuts on SIGTERM."""
    jobs = e2e_jobs
    start(e2e_cluster, jobs, e2e_storage, "tiny", SPOT)
    st = training(jobs, "tiny", 2)
    node = st["controllerNode"]
    e2e_cluster.taint(node, "spotrl.test/evict-now", "true", effect="NoExecute")
    other_node(jobs, "tiny", node)
    # The pod had its grace period (30 s): the SIGTERM's barrier cut committed, and is the one resumed from.
    cut = resumed_cut(jobs, e2e_storage, "tiny")
    assert (cut["kind"], cut["attempt"]) == ("barrier", 1), cut
    st = succeeded(jobs, "tiny")
    assert (st["preemptions"], st["restarts"]) == (1, 0)
    assert_resumed_from(e2e_cluster, jobs, e2e_storage, "tiny", st, cut)
    assert_same_stream(reference, e2e_storage, "tiny")


@pytest.mark.kind_ci
def test_an_abrupt_node_loss_costs_at_most_the_step_in_progress(
    e2e_cluster: Any, e2e_jobs: Jobs, e2e_storage: JobStorage, reference: dict[int, Any]
) -> None:
    """The node goes with no notice (no barrier): the fresh controller resumes from the newest
    periodic cut, a delta cut after every step by default, so at most the step the lost
    controller had not cut is trained again, on the same prompts."""
    jobs = e2e_jobs
    start(e2e_cluster, jobs, e2e_storage, "tiny", SPOT)
    st = jobs.wait(
        "tiny",
        lambda s: (s.get("lastCut") or {}).get("kind") == "periodic" and (s.get("step") or 0) >= 4,
        TRAIN_TIMEOUT,
        "a few steps and their cuts",
    )
    node, cut = st["controllerNode"], st["lastCut"]
    e2e_cluster.lose_node(node)
    other_node(jobs, "tiny", node)
    resumed = time.time()  # just after the fresh controller's first step
    st = jobs.status("tiny")
    assert "barrier" not in st or st["barrier"].get("state") != "Committed", "nobody was left to cut"
    st = succeeded(jobs, "tiny")
    assert (st["preemptions"], st["restarts"]) == (1, 0)
    # The time lost runs from the cut resumed from, not from when the loss was noticed:
    # within the time the test saw, give or take polling and rounding.
    since_cut = resumed - datetime.fromisoformat(cut["time"]).timestamp()
    assert st["secondsLost"] <= since_cut + 30, (st["secondsLost"], since_cut)
    assert "NodeLost" in jobs.reasons("tiny")
    assert int(st["lastCut"]["id"]) > int(cut["id"])
    assert st["lastRecovery"]["kind"] == "abrupt", st["lastRecovery"]
    acc = st["accounting"]
    assert (acc["promptsLost"], acc["promptsTrainedTwice"]) == (0, 0), acc
    # Resumed from the newest cut the lost attempt committed (the one seen above or a later
    # one: status lags the run by a poll), at most one step behind what it had trained.
    records = audit(e2e_storage, "tiny", "--all")
    first, later = min(d["attempt"] for d in records), max(d["attempt"] for d in records)
    resumed_at = min(d["step"] for d in records if d["attempt"] == later)
    trained_before = {d["step"] for d in records if d["attempt"] == first}
    assert cut["step"] <= resumed_at <= max(trained_before) + 1, (resumed_at, cut)
    assert acc["stepsRetrained"] == len({s for s in trained_before if s >= resumed_at}) <= 1, (acc, resumed_at)
    assert st["resume"]["cutId"] != "", st["resume"]
    assert_same_stream(reference, e2e_storage, "tiny")


@pytest.mark.kind_ci  # the chart's two replicas as pods: a real leader killed by its kubelet
def test_the_leading_operator_pod_killed_mid_barrier_is_finished_by_the_standby(
    e2e_cluster: Any, e2e_jobs: Jobs, e2e_storage: JobStorage, reference: dict[int, Any]
) -> None:
    """kind: the chart's two operator replicas; the leader's pod is force-deleted (no grace:
    its process is killed) as soon as the barrier is requested for a drain, and the standby
    takes the Lease and carries the preemption through. On the test control plane,
    test_operator.py kills the operator process mid-barrier with the cut held back."""
    if TARGET != "kind":
        pytest.skip("the chart's replicas run on kind only; test_operator.py kills the operator process mid-barrier")
    jobs, ns = e2e_jobs, os.environ.get("SPOTRL_E2E_OPERATOR_NAMESPACE", "spotrl-system")
    lease = f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/spotrl"
    start(e2e_cluster, jobs, e2e_storage, "tiny", SPOT)
    # The current attempt: a kubelet just given its node back (the test before this one) may
    # reject the first pod at admission, and the operator starts the attempt again.
    st = training(jobs, "tiny", 2, attempt=None)
    node = st["controllerNode"]
    leader = e2e_cluster.admin().get(lease)["spec"]["holderIdentity"]

    e2e_cluster.taint(node, AWS_NOTICE, "true")
    drain = e2e_cluster.drain(node, timeout=300)
    try:
        # The barrier, or already the next attempt (it starts as soon as the cut commits).
        jobs.wait("tiny", lambda s: bool(s.get("barrier")) or s.get("attempt", 0) > 1, 60, "the barrier request")
        e2e_cluster.kubectl("delete", "pod", leader, "-n", ns, "--grace-period=0", "--force")
        wait_until(
            lambda: e2e_cluster.admin().get(lease)["spec"].get("holderIdentity") not in (None, leader),
            60,
            "the standby to take the Lease",
        )
        assert drain.wait(300) == 0, drain.output()
    finally:
        drain.stop()
    other_node(jobs, "tiny", node)
    st = succeeded(jobs, "tiny")
    assert (st["preemptions"], st["restarts"]) == (1, 0)
    committed = [e for e in jobs.events("tiny") if e["reason"] == "BarrierCommitted"]
    assert sum(e.get("count") or 1 for e in committed) == 1, "one barrier cut, not two"
    assert "BarrierMissed" not in jobs.reasons("tiny")
    assert_same_stream(reference, e2e_storage, "tiny")


@pytest.mark.kind_ci  # the deletion pod on a real kubelet: the operator's image, restricted, its termination message
def test_deleting_a_job_with_retention_delete_removes_its_cuts_and_nothing_else(
    e2e_cluster: Any, e2e_jobs: Jobs, e2e_storage: JobStorage
) -> None:
    """The operator's finalizer deletes a training job's cuts and audit from S3 (the job's own
    prefix only) and says so in an Event."""
    jobs = e2e_jobs
    s3 = e2e_storage.client()
    root = f"{jobs.ns}/tiny"  # Delete only ever deletes under <storage>/<namespace>/<name>
    s3.put_object(Bucket=e2e_storage.bucket, Key=f"{jobs.ns}/tiny-other/keep.txt", Body=b"not the job's")
    job = tiny_job("tiny", e2e_storage, SPOT)
    job["spec"]["checkpoint"]["storage"] = e2e_storage.uri(root)
    job["spec"]["checkpoint"]["retentionPolicy"] = "Delete"
    if e2e_cluster.admin().get_or_none(f"/api/v1/namespaces/{jobs.ns}/secrets/s3") is None:
        e2e_cluster.admin().create(f"/api/v1/namespaces/{jobs.ns}/secrets", e2e_storage.secret())
    jobs.create(job)
    jobs.wait("tiny", lambda s: (s.get("lastCut") or {}).get("kind") == "periodic", TRAIN_TIMEOUT, "a periodic cut")
    assert e2e_storage.keys(f"{root}/"), "the job wrote no cuts"

    jobs.delete("tiny", timeout=120)
    assert e2e_storage.keys(f"{root}/") == [], "the job's cuts outlived it"
    assert e2e_storage.keys(f"{jobs.ns}/tiny-other/") == [f"{jobs.ns}/tiny-other/keep.txt"], "a neighbour's went too"
    events = e2e_cluster.admin().get(
        f"/api/v1/namespaces/{jobs.ns}/events", fieldSelector="involvedObject.name=tiny,reason=CutsDeleted"
    )["items"]
    assert events, "no CutsDeleted Event"


def test_a_graceful_shutdown_that_ignores_the_pdb_resumes(
    e2e_cluster: Any, e2e_jobs: Jobs, e2e_storage: JobStorage, reference: dict[int, Any]
) -> None:
    """GKE-style: the node shuts down with pods getting about 15 s (no PDB asked); the
    controller cuts on SIGTERM if it can, otherwise the last periodic cut bounds the loss."""
    if TARGET == "kind":
        pytest.skip(e2e_cluster.graceful_shutdown_reason)
    jobs = e2e_jobs
    start(e2e_cluster, jobs, e2e_storage, "tiny", SPOT)
    st = training(jobs, "tiny", 2)
    node = st["controllerNode"]
    e2e_cluster.graceful_shutdown(node, grace_seconds=15, wait=False)
    other_node(jobs, "tiny", node)
    # The newest cut of attempt 1: the SIGTERM's barrier cut when it committed in the 15 s,
    # else its last periodic cut; the steps it trained past that cut are the ones retrained.
    cut = resumed_cut(jobs, e2e_storage, "tiny")
    print(f"resumed from a {cut['kind']} cut at step {cut['trainer_step']}")
    st = succeeded(jobs, "tiny")
    assert (st["preemptions"], st["restarts"]) == (1, 0)
    assert_resumed_from(e2e_cluster, jobs, e2e_storage, "tiny", st, cut)
    assert_same_stream(reference, e2e_storage, "tiny")


def test_suspend_takes_a_barrier_cut_and_resume_continues_from_it(
    e2e_cluster: Any, e2e_jobs: Jobs, e2e_storage: JobStorage, reference: dict[int, Any]
) -> None:
    jobs = e2e_jobs
    start(e2e_cluster, jobs, e2e_storage, "tiny", SPOT)
    training(jobs, "tiny", 2)
    jobs.patch_spec("tiny", {"suspend": True})
    st = jobs.wait("tiny", lambda s: s.get("phase") == "Suspended", 180, "Suspended")
    assert st["barrier"]["state"] == "Committed"
    assert int(st["lastCut"]["id"]) >= int(st["barrier"]["cutId"])
    assert st["step"] == st["lastCut"]["step"], "trained past the barrier cut"
    wait_until(lambda: jobs.pods("tiny") == [], 60, "no pods while suspended")
    time.sleep(2)
    jobs.patch_spec("tiny", {"suspend": False})
    training(jobs, "tiny", st["lastCut"]["step"] + 1, attempt=2)
    cut = resumed_cut(jobs, e2e_storage, "tiny")
    assert (cut["cut_id"], cut["kind"]) == (st["barrier"]["cutId"], "barrier"), "resumed from the suspend's cut"
    assert cut["trainer_step"] == st["lastCut"]["step"], cut
    st = succeeded(jobs, "tiny")
    assert (st["preemptions"], st["restarts"]) == (0, 0)
    assert_resumed_from(e2e_cluster, jobs, e2e_storage, "tiny", st, cut)
    assert_same_stream(reference, e2e_storage, "tiny")


# ----------------------------------------------------------------------------- many unusable nodes


def local_only(cluster: Any, why: str) -> None:
    if TARGET == "kind":
        pytest.skip(f"{why}; the test control plane covers it")


def controller_pid(cluster: Any, namespace: str, pod: str) -> int:
    pids: dict[str, int] = {}
    wait_until(lambda: bool(pids.update(cluster.pod_pids(namespace, pod)) or pids), 30, f"{pod}'s process")
    return pids["controller"]


def test_with_two_then_three_nodes_unusable_a_job_starts_restarts_and_resumes_on_the_healthy_ones(
    e2e_cluster: Any,
    e2e_jobs: Jobs,
    e2e_storage: JobStorage,
    reference: dict[int, Any],
    e2e_operator: Any,
    request: pytest.FixtureRequest,
) -> None:
    """A reclaim wave over four spot nodes: cordoned, tainted, then NotReady, and a job that
    tolerates every taint, so that only the operator's avoid-list keeps its pods off them (the
    scheduler would not). The job starts with two nodes unusable, crash-restarts with three,
    and is preempted with three, each time on a healthy node."""
    local_only(e2e_cluster, "kind's node set is fixed at cluster creation and this needs four spot nodes")
    from spotrl_e2e.nodeagent.config import NodeSpec

    cluster, jobs = e2e_cluster, e2e_jobs
    extra = ["wave-c", "wave-d"]
    backoff = 30  # the crash backoff: time for a lost node to go NotReady (10 s grace, here)
    for name in extra:
        cluster.add_node(NodeSpec(name, capacity_type="spot", gpus=1))
    try:
        cluster.cordon("spot-a")
        cluster.taint("spot-b", KARPENTER, "true")
        # The job tolerates both, so only the operator's avoid-list keeps its first pod off them: the
        # operator must know of them before the job's first pass. A fresh operator lists every Node
        # before any pass; the running one may hear of the cordon after the job (a race, not a bug).
        e2e_operator.stop()
        request.getfixturevalue("start_operator")()
        if cluster.admin().get_or_none(f"/api/v1/namespaces/{jobs.ns}/secrets/s3") is None:
            cluster.admin().create(f"/api/v1/namespaces/{jobs.ns}/secrets", e2e_storage.secret())
        job = tiny_job("wave", e2e_storage, SPOT)
        job["spec"]["scheduling"]["tolerations"] = [{"operator": "Exists"}]
        job["spec"]["failureBudget"] = {"backoffSeconds": backoff}
        jobs.create(job)

        # Two unusable: the job starts on one of the two healthy nodes; then it crashes.
        pod = "wave-controller-1"
        pid = controller_pid(cluster, jobs.ns, pod)
        home = cluster.admin().get(f"/api/v1/namespaces/{jobs.ns}/pods/{pod}")["spec"]["nodeName"]
        assert home in extra, f"attempt 1 landed on {home}, which was unusable"
        os.kill(pid, signal.SIGKILL)

        # During the crash backoff the other healthy node stops answering: three unusable.
        (lost,) = set(extra) - {home}
        cluster.lose_node(lost)
        cluster.wait_node_condition(lost, "Unknown", timeout=backoff)
        st = jobs.status("wave")
        assert st.get("attempt") == 1, "attempt 2 was created before the third node was unusable"
        st = training(jobs, "wave", 2, attempt=2)
        assert st["restarts"] == 1
        assert st["controllerNode"] == home, f"attempt 2 landed on {st['controllerNode']}, not the healthy {home}"

        # A notice for that node while spot-a is back: still three unusable (spot-b, the lost
        # node, the noticed one), and the preempted controller resumes on spot-a only.
        cluster.uncordon("spot-a")
        cluster.taint(home, AWS_NOTICE, "true")
        drain = cluster.drain(home, timeout=300)
        try:
            st = training(jobs, "wave", st["step"] + 1, attempt=3)
            assert drain.wait(300) == 0, drain.output()
        finally:
            drain.stop()
        assert st["controllerNode"] == "spot-a", f"attempt 3 landed on {st['controllerNode']}"
        st = succeeded(jobs, "wave")
        assert (st["preemptions"], st["restarts"]) == (1, 1)
        assert not [c for c in st.get("conditions") or [] if c["type"] == "ReconcileError"]
        assert "ReconcileFailed" not in jobs.reasons("wave")
        assert_same_stream(reference, e2e_storage, "wave")
    finally:
        for name in extra:
            cluster.delete_node(name)


def test_a_double_preemption_with_the_operator_killed_in_each_ends_with_the_same_stream(
    e2e_cluster: Any,
    e2e_jobs: Jobs,
    e2e_storage: JobStorage,
    reference: dict[int, Any],
    e2e_operator: Any,
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    """A drain after a Karpenter notice, then the fresh controller's node lost abruptly while that
    controller is still starting (held by a failpoint once it has restored, before it trains);
    the operator is SIGKILLed at a random moment of each and a new one takes over."""
    local_only(e2e_cluster, "on kind the operator is the chart's Deployment, not a process of the test")
    start_operator = request.getfixturevalue("start_operator")
    seed = int(os.environ.get("SPOTRL_TEST_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    print(f"seed {seed} (SPOTRL_TEST_SEED={seed} repeats it)")
    cluster, jobs = e2e_cluster, e2e_jobs
    held = tmp_path / "failpoints"
    held.mkdir()
    held.chmod(0o777)  # the pods' user writes its marks here
    holding = ("--runtime-env", "SPOTRL_FAILPOINTS=run.resumed=300", "--runtime-env", f"SPOTRL_FAILPOINT_DIR={held}")
    e2e_operator.stop()
    operator = start_operator(args=holding)

    def kill_operator_within(seconds: float) -> None:
        nonlocal operator
        time.sleep(rng.uniform(0, seconds))
        operator.kill(signal.SIGKILL)
        operator = start_operator(args=holding)

    start(cluster, jobs, e2e_storage, "twice", {})
    st = training(jobs, "twice", 2)
    first = st["controllerNode"]
    cluster.taint(first, KARPENTER, "true")
    drain = cluster.drain(first, timeout=300)
    try:
        kill_operator_within(3.0)
        assert drain.wait(300) == 0, drain.output()
    finally:
        drain.stop()

    # The fresh controller has restored and not trained (held): its node goes.
    pod = "twice-controller-2"
    wait_until((held / "run.resumed").exists, TRAIN_TIMEOUT, f"{pod} restored, held before it trains")
    st = jobs.status("twice")
    assert st.get("stepAttempt") != 2, "attempt 2 trained before its node could be lost"
    second = next(p["spec"]["nodeName"] for p in jobs.pods("twice") if p["metadata"]["name"] == pod)
    assert second != first
    cluster.lose_node(second)
    (held / "run.resumed.release").touch()  # the third attempt, when it has restored, goes on
    kill_operator_within(3.0)

    st = training(jobs, "twice", 1, attempt=3)
    assert st["controllerNode"] not in (first, second)
    st = succeeded(jobs, "twice")
    assert (st["preemptions"], st["restarts"]) == (2, 0), json.dumps(st, indent=1)
    assert "NodeLost" in jobs.reasons("twice")
    assert_same_stream(reference, e2e_storage, "twice")


def test_two_jobs_on_one_storage_the_newer_waits_and_a_refusal_is_no_crash(
    e2e_cluster: Any, e2e_jobs: Jobs, e2e_storage: JobStorage, reference: dict[int, Any]
) -> None:
    """The slip of two RLJobs on one storage. While the first trains, the second waits with
    StorageConflict and no pod; the first is never fenced and trains the undisturbed stream.
    Once the first has finished it holds the store no more, and the second's controller finds
    the store is another job's and refuses it (exit 3) without writing there: StorageRefused,
    no crash, no new pod, until its spec names its own storage."""
    jobs = e2e_jobs
    start(e2e_cluster, jobs, e2e_storage, "tiny", SPOT)
    training(jobs, "tiny", 2)
    second = tiny_job("tiny-b", e2e_storage, SPOT)
    second["spec"]["checkpoint"]["storage"] = e2e_storage.uri("tiny")
    jobs.create(second)
    st = jobs.wait(
        "tiny-b", lambda s: any(c["type"] == "StorageConflict" for c in s.get("conditions") or []), 60, "the conflict"
    )
    (cond,) = [c for c in st["conditions"] if c["type"] == "StorageConflict"]
    assert cond["status"] == "True"
    assert f"is also the storage of RLJob {jobs.ns}/tiny ({e2e_storage.uri('tiny')})" in cond["message"]
    assert st["phase"] == "Pending"
    # The operator posts a pass's Events after its status write, so the Event may land a moment later.
    wait_until(lambda: "StorageConflict" in jobs.reasons("tiny-b"), 10, "the StorageConflict Event")
    assert jobs.pods("tiny-b") == [], "the second job started a pod while the first one trained on the store"

    def objects() -> dict[str, str]:
        pages = (
            e2e_storage.client().get_paginator("list_objects_v2").paginate(Bucket=e2e_storage.bucket, Prefix="tiny/")
        )
        return {o["Key"]: o["ETag"] for page in pages for o in page.get("Contents") or []}

    st = succeeded(jobs, "tiny")
    before = objects()  # the first job's last write is its last cut, before it says Succeeded
    assert (st["preemptions"], st["restarts"], st["attempt"]) == (0, 0, 1), "the first job was never fenced"
    assert_same_stream(reference, e2e_storage, "tiny")
    st = jobs.wait(
        "tiny-b",
        storage_refused,
        TRAIN_TIMEOUT,
        "the second job's controller to refuse the finished one's store",
    )
    (cond,) = [c for c in st["conditions"] if c["type"] == "StorageRefused"]
    assert "[job_identity]" in cond["message"], cond
    assert "the store belongs to job" in cond["message"], cond
    assert (st["restarts"], st["attempt"], st["phase"]) == (0, 1, "Pending"), json.dumps(st, indent=1)
    assert objects() == before, "the refused controller wrote into the other job's store"
    time.sleep(5)  # several passes: nothing more is started or counted
    st = jobs.status("tiny-b")
    assert (st["restarts"], st["attempt"]) == (0, 1)
    assert not [p for p in jobs.pods("tiny-b") if p["status"].get("phase") not in ("Failed", "Succeeded")]

    jobs.patch_spec("tiny-b", {"checkpoint": {"storage": e2e_storage.uri("tiny-b")}, "training": {"totalSteps": 2}})
    st = jobs.wait("tiny-b", lambda s: s.get("phase") in ("Succeeded", "Failed"), TRAIN_TIMEOUT, "tiny-b to finish")
    assert st["phase"] == "Succeeded", json.dumps(st, indent=1)
    assert (st["attempt"], st["restarts"], st["preemptions"]) == (2, 0, 0)
    assert objects() == before


def bare_node(name: str) -> dict[str, Any]:
    """A Node object no kubelet answers for: the node lifecycle controller marks it Unknown."""
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"spotrl.dev/bare": "true"}}}


def ready_unknown(cluster: Any, name: str) -> bool:
    node = cluster.admin().get(f"/api/v1/nodes/{name}")
    ready = [c for c in (node.get("status") or {}).get("conditions") or [] if c["type"] == "Ready"]
    return bool(ready) and ready[0]["status"] == "Unknown"


def paused(st: dict[str, Any], status: str) -> bool:
    return any(c["type"] == "ForceDeletesPaused" and c["status"] == status for c in st.get("conditions") or [])


@on_the_test_control_plane
def test_with_most_nodes_unknown_at_once_no_controller_is_force_deleted_then_one_lost_node_is(
    cluster: Any, jobs: Jobs, e2e_storage: JobStorage, start_operator: Any
) -> None:
    """Five Node objects no kubelet renews, then the controller's node lost: more than 55% of the
    nodes unhealthy, likelier a control-plane or network problem than that many nodes gone. The
    operator waits (ForceDeletesPaused) instead of force-deleting the controller. Once the others
    are gone only one node is lost, and after the grace period its job moves on."""
    operator = start_operator()
    admin = cluster.admin()
    bare = [f"bare-{i}" for i in range(5)]
    admin.create(f"/api/v1/namespaces/{jobs.ns}/secrets", e2e_storage.secret())
    job = tiny_job("tiny", e2e_storage, SPOT)
    job["spec"]["training"]["totalSteps"] = 100_000  # still training whatever the test waits for
    jobs.create(job)
    st = jobs.wait("tiny", lambda s: (s.get("step") or 0) >= 1, TRAIN_TIMEOUT, "the first step")
    node = st["controllerNode"]
    try:
        for name in bare:
            admin.create("/api/v1/nodes", bare_node(name))
        wait_until(lambda: all(ready_unknown(cluster, n) for n in bare), 60, "the bare nodes Unknown")
        cluster.lose_node(node)
        wait_until(lambda: ready_unknown(cluster, node), 60, f"{node} Unknown")
        jobs.wait("tiny", lambda s: paused(s, "True"), 30, "the operator to pause its force deletes")
        time.sleep(10)  # five times the operator's grace period here: still no force delete
        assert jobs.status("tiny")["attempt"] == 1
        assert operator.metrics()["spotrl_operator_force_deletes_paused"] == 1
        names = [p["metadata"]["name"] for p in jobs.pods("tiny") if p["metadata"].get("deletionTimestamp") is None]
        assert "tiny-controller-1" in names, "the controller was deleted while the brake held"
    finally:
        for name in bare:
            admin.delete(f"/api/v1/nodes/{name}")
    st = jobs.wait("tiny", lambda s: s.get("attempt", 0) >= 2, 60, "one node lost: the job moves on")
    assert paused(st, "False")
    assert "NodeLost" in jobs.reasons("tiny")
    cluster.restore_node(node)


ZONE = "topology.kubernetes.io/zone"


def zone_nodes(admin: Any, zones: dict[str, str | None]) -> None:
    """Labels each Node with its zone (None: the label removed)."""
    for name, zone in zones.items():
        admin.patch(f"/api/v1/nodes/{name}", {"metadata": {"labels": {ZONE: zone}}})


@on_the_test_control_plane
def test_per_zone_a_partial_zone_holds_its_controller_and_a_zone_wholly_down_loses_it(
    cluster: Any, jobs: Jobs, e2e_storage: JobStorage, start_operator: Any
) -> None:
    """Zone x: the controller's node lost and two bare Nodes (3 of 4 not Ready): partially
    disrupted, no force delete there. Then x's Ready node moves to zone y: x is wholly down
    while y answers, so x is gone and the job moves on, though 3 of 5 nodes (60%) are unhealthy
    fleet-wide, above the share that once paused every force delete."""
    operator = start_operator()
    admin = cluster.admin()
    bare = ["bare-x0", "bare-x1"]
    admin.create(f"/api/v1/namespaces/{jobs.ns}/secrets", e2e_storage.secret())
    job = tiny_job("tiny", e2e_storage, SPOT)
    job["spec"]["training"]["totalSteps"] = 100_000  # still training whatever the test waits for
    # The lost node's barrier is never answered: a long deadline, so that only a force delete
    # (the zone wholly down), not a missed barrier, moves the job on within the test.
    job["spec"]["checkpoint"]["barrierDeadlineSeconds"] = 300
    jobs.create(job)
    st = jobs.wait("tiny", lambda s: (s.get("step") or 0) >= 1, TRAIN_TIMEOUT, "the first step")
    node = st["controllerNode"]
    mate = "spot-b" if node == "spot-a" else "spot-a"  # the other spot node: the next controller's
    other = "ondemand-a"
    try:
        zone_nodes(admin, {node: "x", mate: "x", other: "y"})
        for name in bare:
            admin.create("/api/v1/nodes", {**bare_node(name), "metadata": {"name": name, "labels": {ZONE: "x"}}})
        wait_until(lambda: all(ready_unknown(cluster, n) for n in bare), 60, "the bare nodes Unknown")
        cluster.lose_node(node)
        wait_until(lambda: ready_unknown(cluster, node), 60, f"{node} Unknown")
        st = jobs.wait("tiny", lambda s: paused(s, "True"), 30, "the operator to pause its force deletes in zone x")
        (cond,) = [c for c in st["conditions"] if c["type"] == "ForceDeletesPaused"]
        assert "3 of the 4 nodes of zone x are not Ready" in cond["message"], cond
        time.sleep(6)  # three times the operator's grace period here: still no force delete
        assert jobs.status("tiny")["attempt"] == 1
        assert operator.metrics()["spotrl_operator_force_deletes_paused"] == 1
        zone_nodes(admin, {mate: "y"})  # zone x: wholly down; zone y: two nodes Ready
        st = jobs.wait("tiny", lambda s: s.get("attempt", 0) >= 2, 60, "zone x gone: the job moves on")
        assert paused(st, "False")
        # The operator posts a pass's Events after its status write: the Event may land a moment later.
        wait_until(lambda: "NodeLost" in jobs.reasons("tiny"), 10, "the NodeLost Event: a force delete")
    finally:
        for name in bare:
            admin.delete(f"/api/v1/nodes/{name}")
        zone_nodes(admin, {node: None, mate: None, other: None})
        cluster.restore_node(node)
