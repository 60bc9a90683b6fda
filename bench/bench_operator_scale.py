"""The operator at fleet scale on the test control plane: many RLJobs, thousands of Nodes.

    PYTHONPATH=e2e python bench/bench_operator_scale.py [--jobs 500] [--nodes 2000]
        [--small-jobs 10] [--small-nodes 10] [--rounds 20] [--burst 50] [--window 30]
        [--operator-args "--reconcile-interval 2"] [--operator-src PATH] [--compare-src PATH] [--check]

One control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler; one node
agent node), its node lifecycle controller given an hour of grace, so that Nodes no kubelet
heartbeats stay Ready. For each scale (the small baseline first, then the fleet), on the
same cluster:

1. **the fleet**: ``--nodes`` Node objects (``fleet-00001`` ...) made through the API, no
   kubelet: a GPU spot node's labels, capacity, addresses, node info and 40 images in
   their status (~18 KB a Node, as real GPU nodes carry), Ready=True; the bench lifts the
   not-ready taint new Nodes get at admission (the lifecycle controller would, at ~5 a second).
2. **the jobs**: for each of ``--jobs`` RLJobs, a stand-in controller pod bound to a fleet
   node of its own (``<job>-controller-1``, the job's labels; its status set to Running and
   Ready by the bench, as nothing runs it), then the RLJob, which the operator adopts the
   pod for (attempt 1) until it says ``phase: Running``. The jobs' barrier deadline is an
   hour: a request nobody answers stays Requested and moves nothing.
3. **steady state**: over ``--window`` seconds with nothing happening, the operator's CPU
   (utime + stime of its processes, /proc) and the API server's request rate (the sum of
   ``apiserver_request_total`` from its /metrics); the same rate over the same window
   before the operator started is the control plane's own, the difference the operator's.
   Each window waits for the API server to calm down first (5 s slices): before the
   operator, to about the bare control plane's rate (kube-controller-manager sends a GET and
   a PATCH per new Node, ~9 a second here, and Events); with it, to about the first window's.
4. **notices**: ``--rounds`` times, a random job's node tainted ``karpenter.sh/disrupted``
   (one write; t0 when it is sent) until a watch on the RLJobs shows that job's
   ``status.barrier.state == Requested``, then untainted; then ``--burst`` nodes tainted at
   once (8 writers; each latency from its own write). Each job is noticed once: when none
   is left unused, the used ones are deleted and made again (new names, same nodes).
5. **memory**: the operator's peak resident size (VmHWM, summed over its processes) at the
   end, against the chart's ``resources.limits.memory`` (charts/spotrl/values.yaml).

Then the jobs are deleted (the operator's finalizer lets them go; the bench force-deletes
their pods, which no kubelet would ever confirm), the namespace, and the operator stops.

The operator runs as ``python -m spotrl_operator`` with the admin kubeconfig, no leader
election, and otherwise its defaults (the chart's: reconcile interval 30 s, 50 requests/s);
``--operator-args`` adds flags. ``--operator-src PATH`` runs the operator of another checkout
(its ``operator/`` and ``runtime/`` first on PYTHONPATH); ``--compare-src PATH`` measures
everything a second time with that checkout's operator, in the same run on the same cluster,
and prints both. The CRD is this checkout's. Goal: notice → request p95 ≤ 2 s at scale, and
the peak memory within the chart's limit.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import os
import random
import re
import shlex
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from _operator_bench import idle_pod, pct
from _targets import Targets, add_check
from spotrl_e2e.cluster import Cluster
from spotrl_e2e.controlplane import Timings
from spotrl_e2e.kube import ApiError, KubeClient, path
from spotrl_e2e.nodeagent.config import NodeSpec
from spotrl_e2e.procs import Process, free_port, port_open

REPO = Path(__file__).resolve().parents[1]
RLJOBS = "spotrl.dev/v1alpha1"
TAINT = "karpenter.sh/disrupted"
FLEET_LABEL = "bench.spotrl.dev/fleet"
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
Obj = dict[str, Any]


# --------------------------------------------------------------------------- small helpers


def ms(values: list[float], q: float | None) -> str:
    """A percentile (None: the max) in ms, or n/a."""
    if not values:
        return "n/a"
    return f"{(max(values) if q is None else pct(values, q)) * 1000:.0f}"


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def each(fn: Callable[[Any], Any], items: Iterable[Any], threads: int = 4) -> list[Any]:
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(fn, items))


def say(message: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {message}", flush=True)


def quantity_mib(q: str) -> float:
    """A Kubernetes memory quantity (512Mi, 1Gi, 500M, bytes) in MiB."""
    m = re.fullmatch(r"([0-9.]+)([KMGT]i?)?", q.strip())
    if not m:
        raise ValueError(f"not a memory quantity: {q!r}")
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    return float(m.group(1)) * units.get(m.group(2) or "", 1) / 2**20


def chart_memory_limit_mib() -> float:
    values = yaml.safe_load((REPO / "charts" / "spotrl" / "values.yaml").read_text())
    return quantity_mib(str(values["resources"]["limits"]["memory"]))


# --------------------------------------------------------------------------- processes (/proc)


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        tree += frontier
    return tree


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def peak_mib(pids: list[int]) -> float:
    """VmHWM (peak resident set) summed over the processes."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, StopIteration, ValueError):
            lines = Path(f"/proc/{pid}/status").read_text().splitlines()
            total += int(next(x for x in lines if x.startswith("VmHWM:")).split()[1]) / 1024
    return total


# --------------------------------------------------------------------------- the API server's metrics


def api_requests(admin: KubeClient) -> float:
    """The API server's requests so far: ``apiserver_request_total`` summed over its series."""
    text = admin.request("GET", "/metrics")["raw"]
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("apiserver_request_total{")
    )


def window(admin: KubeClient, seconds: float, pid: int | None = None) -> tuple[float, float]:
    """(API requests/s, CPU cores of ``pid``'s processes) over ``seconds``."""
    pids = process_tree(pid) if pid else []
    c0, r0, t0 = cpu_seconds(pids), api_requests(admin), time.monotonic()
    time.sleep(seconds)
    c1, r1, t1 = cpu_seconds(pids), api_requests(admin), time.monotonic()
    return (r1 - r0) / (t1 - t0), (c1 - c0) / (t1 - t0)


def settle(admin: KubeClient, calm: float, timeout: float, what: str) -> None:
    """Waits until the API server's request rate over 5 s is at most ``calm`` (the controllers
    work through new Nodes, a deleted namespace ... at their client's rate limit for a while)."""
    deadline = time.monotonic() + timeout
    while (rate := window(admin, 5)[0]) > calm:
        if time.monotonic() > deadline:
            say(f"warning: {what}: still {rate:.1f} requests/s after {timeout:.0f} s; measuring anyway")
            return


# --------------------------------------------------------------------------- the fleet: API-only Nodes

IMAGES = [
    {
        "names": [
            f"123456789012.dkr.ecr.us-east-1.amazonaws.com/ml/team-{k:02d}/image-{k:02d}"
            f"@sha256:{hashlib.sha256(f'image-{k}'.encode()).hexdigest()}",
            f"123456789012.dkr.ecr.us-east-1.amazonaws.com/ml/team-{k:02d}/image-{k:02d}:v1.{k}.0-cuda12.4",
            f"123456789012.dkr.ecr.us-east-1.amazonaws.com/ml/team-{k:02d}/image-{k:02d}:latest",
        ],
        "sizeBytes": 300_000_000 + 97_000_000 * k,
    }
    for k in range(40)
]
CAPACITY = {
    "cpu": "96",
    "memory": "1176495384Ki",
    "pods": "110",
    "nvidia.com/gpu": "8",
    "ephemeral-storage": "7499362304Ki",
    "hugepages-1Gi": "0",
    "hugepages-2Mi": "0",
}
ALLOCATABLE = {**CAPACITY, "cpu": "95690m", "memory": "1165432088Ki", "ephemeral-storage": "6910268432Ki"}


def fleet_name(i: int) -> str:
    return f"fleet-{i:05d}"


def fleet_node(name: str, i: int) -> Obj:
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "node.kubernetes.io/instance-type": "p4d.24xlarge",
        "topology.kubernetes.io/region": "us-east-1",
        "topology.kubernetes.io/zone": f"us-east-1{'abcd'[i % 4]}",
        "karpenter.sh/capacity-type": "spot",
        "karpenter.sh/nodepool": "gpu",
        "nvidia.com/gpu.present": "true",
        FLEET_LABEL: "true",
    }
    spec = {"providerID": f"aws:///us-east-1{'abcd'[i % 4]}/i-{hashlib.md5(name.encode()).hexdigest()[:17]}"}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}, "spec": spec}


def fleet_status(name: str, i: int) -> Obj:
    t = now()

    def cond(kind: str, status: str, reason: str) -> Obj:
        return {"type": kind, "status": status, "reason": reason, "message": reason,
                "lastHeartbeatTime": t, "lastTransitionTime": t}  # fmt: skip

    return {
        "status": {
            "capacity": CAPACITY,
            "allocatable": ALLOCATABLE,
            "conditions": [
                cond("MemoryPressure", "False", "KubeletHasSufficientMemory"),
                cond("DiskPressure", "False", "KubeletHasNoDiskPressure"),
                cond("PIDPressure", "False", "KubeletHasSufficientPID"),
                cond("Ready", "True", "KubeletReady"),
            ],
            "addresses": [
                {"type": "InternalIP", "address": f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}"},
                {"type": "Hostname", "address": name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {
                "machineID": hashlib.md5(f"m{name}".encode()).hexdigest(),
                "systemUUID": hashlib.md5(f"s{name}".encode()).hexdigest(),
                "bootID": hashlib.md5(f"b{name}".encode()).hexdigest(),
                "kernelVersion": "6.1.112-124.190.amzn2023.x86_64",
                "osImage": "Amazon Linux 2023.6.20241031",
                "containerRuntimeVersion": "containerd://1.7.22",
                "kubeletVersion": "v1.31.2-eks-94953ac",
                "kubeProxyVersion": "v1.31.2-eks-94953ac",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
            "images": IMAGES,
        }
    }


class Fleet:
    """The API-only Nodes ``fleet-00001`` ... ``fleet-<count>`` (the bench is their only writer)."""

    def __init__(self, admin: KubeClient):
        self.admin, self.count = admin, 0

    def names(self, n: int) -> list[str]:
        return [fleet_name(i) for i in range(1, n + 1)]

    def _create(self, i: int) -> None:
        name = fleet_name(i)
        made = self.admin.create(path("v1", "nodes"), fleet_node(name, i))
        self.admin.patch(path("v1", "nodes", None, name, "status"), fleet_status(name, i))
        # The admission plugin TaintNodesByCondition puts node.kubernetes.io/not-ready on every new
        # Node; the node lifecycle controller lifts it at ~5 nodes/s here. The Node is Ready now.
        taints = [t for t in made["spec"].get("taints") or [] if t["key"] != NOT_READY_TAINT]
        self.admin.patch(path("v1", "nodes", None, name), {"spec": {"taints": taints or None}})

    def _delete(self, i: int) -> None:
        self.admin.delete(path("v1", "nodes", None, fleet_name(i)))

    def ensure(self, n: int) -> None:
        """Exactly ``n`` fleet nodes, each Ready without the control plane's not-ready taint."""
        t0 = time.monotonic()
        if n > self.count:
            each(self._create, range(self.count + 1, n + 1))
        elif n < self.count:
            each(self._delete, range(n + 1, self.count + 1))
        self.count = n
        deadline = time.monotonic() + 120 + n / 10
        while (left := self._unsettled(n)) and time.monotonic() < deadline:
            time.sleep(1)
        if left:
            raise TimeoutError(f"fleet: {left} nodes not settled (count or not-ready taint)")
        say(f"fleet: {n} nodes in {time.monotonic() - t0:.1f} s")

    def _unsettled(self, n: int) -> int:
        items = self.admin.get(path("v1", "nodes"), labelSelector=f"{FLEET_LABEL}=true")["items"]
        tainted = [x for x in items if any(t["key"] == NOT_READY_TAINT for t in x["spec"].get("taints") or [])]
        return len(tainted) + abs(len(items) - n)


def set_taint(admin: KubeClient, node: str, on: bool) -> float:
    """Adds or removes the notice taint in one write (resourceVersion-guarded); returns when it was sent."""
    url = path("v1", "nodes", None, node)
    for _ in range(10):
        obj = admin.get(url)
        taints = [t for t in obj["spec"].get("taints") or [] if t["key"] != TAINT]
        if on:
            taints.append({"key": TAINT, "value": "true", "effect": "NoSchedule"})
        patch = {"metadata": {"resourceVersion": obj["metadata"]["resourceVersion"]}, "spec": {"taints": taints}}
        t0 = time.monotonic()
        try:
            admin.patch(url, patch)
            return t0
        except ApiError as err:
            if err.status != 409:
                raise
    raise RuntimeError(f"node {node}: kept conflicting")


# --------------------------------------------------------------------------- the jobs


def running_status() -> Obj:
    """What a kubelet would write for a started pod (none runs these)."""
    t = now()
    conds = [{"type": c, "status": "True", "lastTransitionTime": t}
             for c in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]  # fmt: skip
    container = {"name": "controller", "image": "idle", "imageID": "", "ready": True, "started": True,
                 "restartCount": 0, "state": {"running": {"startedAt": t}}}  # fmt: skip
    return {"status": {"phase": "Running", "startTime": t, "conditions": conds, "containerStatuses": [container]}}


def rljob(name: str) -> Obj:
    spec = {
        "policy": {"model": "builtin:tiny-arith"},
        "dataset": {"uri": "builtin:arithmetic"},
        "reward": {"name": "arithmetic_exact"},
        "training": {"totalSteps": 1000, "microBatchSize": 8},
        # an hour: a request nobody answers stays Requested (no Missed, no new attempt)
        "checkpoint": {"storage": f"s3://bench-bucket/{name}", "barrierDeadlineSeconds": 3600},
    }
    return {"apiVersion": RLJOBS, "kind": "RLJob", "metadata": {"name": name}, "spec": spec}


class JobSet:
    """The bench's RLJobs of one namespace, each with its stand-in controller on a node of its own."""

    def __init__(self, admin: KubeClient, ns: str):
        self.admin, self.ns = admin, ns
        self.node: dict[str, str] = {}
        self.used: set[str] = set()
        self.serial = 0

    def unused(self) -> list[str]:
        return sorted(n for n in self.node if n not in self.used)

    def place(self, nodes: list[str]) -> list[str]:
        """Running stand-in controller pods on ``nodes``; returns the names of their jobs-to-be."""
        names = []
        for node in nodes:
            self.serial += 1
            names.append(f"j{self.serial:05d}")
            self.node[names[-1]] = node
        each(self._pod, names)
        return names

    def _pod(self, name: str) -> None:
        self.admin.create(path("v1", "pods", self.ns), idle_pod(name, self.node[name]))
        self.admin.patch(path("v1", "pods", self.ns, f"{name}-controller-1", "status"), running_status())

    def submit(self, names: list[str]) -> None:
        each(lambda n: self.admin.create(path(RLJOBS, "rljobs", self.ns), rljob(n)), names)

    def wait_running(self, names: list[str]) -> None:
        want, deadline = set(names), time.monotonic() + 120 + len(names)
        while True:
            items = self.admin.get(path(RLJOBS, "rljobs", self.ns))["items"]
            running = {j["metadata"]["name"] for j in items if (j.get("status") or {}).get("phase") == "Running"}
            if want <= running:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(want & running)} of {len(want)} jobs Running")
            time.sleep(1)

    def retire(self, names: list[str]) -> None:
        """Deletes the jobs (the operator's finalizer must let them go) and force-deletes their
        pods, which no kubelet would confirm gone."""
        if not names:
            return
        each(lambda n: self.admin.delete(path(RLJOBS, "rljobs", self.ns, n)), names)
        selector = f"spotrl.dev/job in ({','.join(names)})"
        deadline = time.monotonic() + 120 + len(names)
        while True:
            self.admin.delete(path("v1", "pods", self.ns), labelSelector=selector, gracePeriodSeconds=0)
            items = self.admin.get(path(RLJOBS, "rljobs", self.ns))["items"]
            if not {j["metadata"]["name"] for j in items} & set(names):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"RLJobs of {self.ns} not gone: the finalizer kept them")
            time.sleep(1)
        for n in names:
            self.node.pop(n, None)
            self.used.discard(n)

    def recycle(self, names: list[str]) -> None:
        """Used jobs made again: deleted, then new ones (new names) on the same nodes, Running."""
        nodes = [self.node[n] for n in names]
        self.retire(names)
        fresh = self.place(nodes)
        self.submit(fresh)
        self.wait_running(fresh)
        time.sleep(2)  # let the operator settle


class Watcher:
    """Records, per RLJob of a namespace, when a watch first shows its barrier Requested."""

    def __init__(self, admin: KubeClient, namespace: str):
        self.admin, self.ns = admin, namespace
        self.seen: dict[str, float] = {}
        self.stop = False
        self.rv = self._list()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _list(self) -> str:
        listing = self.admin.get(path(RLJOBS, "rljobs", self.ns))
        for job in listing["items"]:
            self._note(job)
        return str(listing["metadata"]["resourceVersion"])

    def _note(self, job: Obj) -> None:
        name = job["metadata"]["name"]
        if name not in self.seen and ((job.get("status") or {}).get("barrier") or {}).get("state") == "Requested":
            self.seen[name] = time.monotonic()

    def _run(self) -> None:
        while not self.stop:
            try:
                for event in self.admin.watch(
                    path(RLJOBS, "rljobs", self.ns), self.rv, timeout_seconds=30, stop=lambda: self.stop
                ):
                    self.rv = event["object"]["metadata"]["resourceVersion"]
                    if event["type"] != "BOOKMARK":
                        self._note(event["object"])
            except ApiError as err:
                if err.status != 410:
                    raise
                self.rv = self._list()

    def wait(self, names: list[str], timeout: float) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while not all(n in self.seen for n in names) and time.monotonic() < deadline:
            time.sleep(0.01)
        return {n: self.seen[n] for n in names if n in self.seen}

    def close(self) -> None:
        self.stop = True


# --------------------------------------------------------------------------- the operator


def start_operator(cluster: Cluster, workdir: Path, tag: str, src: Path | None, extra: list[str]) -> Process:
    port = free_port()
    argv = [sys.executable, "-m", "spotrl_operator", "--kubeconfig", str(cluster.kubeconfig),
            "--no-leader-election", "--metrics-address", "127.0.0.1", "--metrics-port", str(port), *extra]  # fmt: skip
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(src / "operator"), str(src / "runtime"), env.get("PYTHONPATH", "")])
    op = Process(f"operator-{tag}", argv, workdir, env).start()
    # "ready: running RLJobs" in this revision's log; an older one may say it otherwise
    op.wait_ready(lambda: "ready: running RLJobs" in op.log.read_text() or port_open("127.0.0.1", port), 120, "ready")
    return op


# --------------------------------------------------------------------------- one scale


@dataclass
class Result:
    label: str
    jobs: int
    nodes: int
    notice: list[float] = field(default_factory=list)
    burst: list[float] = field(default_factory=list)
    adopt_s: float = 0.0
    cpu: float = 0.0
    peak_mib: float = 0.0
    base_rps: float = 0.0
    steady_rps: float = 0.0


def notice_rounds(admin: KubeClient, jobs: JobSet, watcher: Watcher, rounds: int, rng: random.Random) -> list[float]:
    out = []
    for _ in range(rounds):
        if not jobs.unused():
            jobs.recycle(sorted(jobs.used))
        name = rng.choice(jobs.unused())
        t0 = set_taint(admin, jobs.node[name], True)
        seen = watcher.wait([name], 30)
        set_taint(admin, jobs.node[name], False)
        jobs.used.add(name)
        if name in seen:
            out.append(seen[name] - t0)
        else:
            say(f"warning: {name} got no barrier request within 30 s")
        time.sleep(0.5)
    return out


def notice_burst(admin: KubeClient, jobs: JobSet, watcher: Watcher, n: int, rng: random.Random) -> list[float]:
    if len(jobs.unused()) < n:
        jobs.recycle(sorted(jobs.used))
    names = rng.sample(jobs.unused(), n)
    sent = dict(zip(names, each(lambda x: set_taint(admin, jobs.node[x], True), names, threads=8), strict=True))
    seen = watcher.wait(names, 30 + n)
    each(lambda x: set_taint(admin, jobs.node[x], False), names, threads=8)
    jobs.used.update(names)
    if len(seen) < n:
        say(f"warning: {n - len(seen)} of {n} burst jobs got no barrier request")
    return [seen[x] - sent[x] for x in names if x in seen]


def notices(admin: KubeClient, jobs: JobSet, r: Result, args: argparse.Namespace) -> None:
    """The single notices, then the burst, each latency from a watch on the jobs."""
    rng = random.Random(args.seed)
    watcher = Watcher(admin, jobs.ns)
    try:
        r.notice = notice_rounds(admin, jobs, watcher, args.rounds, rng)
        say(f"{r.label}: notices p50 {ms(r.notice, 0.5)} ms, p95 {ms(r.notice, 0.95)} ms")
        r.burst = notice_burst(admin, jobs, watcher, min(args.burst, r.jobs), rng)
        say(f"{r.label}: burst p50 {ms(r.burst, 0.5)} ms, p95 {ms(r.burst, 0.95)} ms")
    finally:
        watcher.close()


def measure(
    cluster: Cluster, fleet: Fleet, workdir: Path, r: Result, args: argparse.Namespace, src: Path | None
) -> None:
    admin = cluster.admin()
    fleet.ensure(r.nodes)
    ns = cluster.create_namespace(f"scale-{r.jobs}")
    jobs = JobSet(admin, ns)
    names = jobs.place(fleet.names(r.jobs))
    settle(admin, 1.5 * args.quiet_rps + 1, 60 + r.nodes / 5, "before the operator")
    r.base_rps, _ = window(admin, args.window)
    say(f"{r.label}: control plane alone {r.base_rps:.1f} requests/s")
    op = start_operator(cluster, workdir, f"{r.label}-{r.jobs}", src, shlex.split(args.operator_args))
    try:
        t0 = time.monotonic()
        jobs.submit(names)
        jobs.wait_running(names)
        r.adopt_s = time.monotonic() - t0
        say(f"{r.label}: {r.jobs} jobs Running {r.adopt_s:.1f} s after their creation")
        settle(admin, 1.5 * r.base_rps + 2, 120, "with the operator")
        assert op.pid is not None
        r.steady_rps, r.cpu = window(admin, args.window, op.pid)
        say(f"{r.label}: steady: {r.steady_rps:.1f} requests/s, operator {r.cpu:.3f} cores")
        notices(admin, jobs, r, args)
        r.peak_mib = peak_mib(process_tree(op.pid))
    finally:
        with contextlib.suppress(Exception):
            jobs.retire(sorted(jobs.node))
        op.stop()
    cluster.delete_namespace(ns, wait=True, timeout=120)


def run_source(
    cluster: Cluster, fleet: Fleet, workdir: Path, args: argparse.Namespace, src: Path | None
) -> list[Result]:
    label = "this" if src is None else src.name or str(src)
    results = [Result(label, args.small_jobs, args.small_nodes), Result(label, args.jobs, args.nodes)]
    for r in results:
        print(f"{label}: {r.jobs} jobs on {r.nodes} nodes", flush=True)
        measure(cluster, fleet, workdir, r, args, src)
    return results


# --------------------------------------------------------------------------- report


def row(r: Result, limit: float) -> str:
    scale = f"{r.label[:12]}: {r.jobs} jobs, {r.nodes} nodes"
    api = f"{r.steady_rps - r.base_rps:.1f} ({r.base_rps:.1f} → {r.steady_rps:.1f})"
    return (
        f"{scale:<34} | {ms(r.notice, 0.5):>6} {ms(r.notice, 0.95):>6} {ms(r.notice, None):>6} | "
        f"{ms(r.burst, 0.5):>6} {ms(r.burst, 0.95):>6} | {r.cpu:7.3f} | "
        f"{r.peak_mib:5.0f} ({100 * r.peak_mib / limit:3.0f}%) | {api:^24} | {r.adopt_s:6.1f}"
    )


def ratio(big: list[float], small: list[float], q: float) -> str:
    if not big or not small:
        return "n/a"
    return f"{pct(big, q) / max(pct(small, q), 1e-9):.2f}x"


def report(results: list[list[Result]], limit: float, check: bool) -> None:
    print()
    print(
        f"{'scale':<34} | {'notice→request ms':^20} | {'burst ms':^13} | {'op CPU':^7} | {'peak MiB':^12} | "
        f"{'API req/s: operator':^24} | {'adopt'}"
    )
    print(
        f"{'':<34} | {'p50':>6} {'p95':>6} {'max':>6} | {'p50':>6} {'p95':>6} | {'cores':^7} | "
        f"{'(% limit)':^12} | {'(alone → with it)':^24} | {'s':>6}"
    )
    for small, big in results:
        print(row(small, limit))
        print(row(big, limit))
    print()
    for small, big in results:
        print(
            f"{small.label}: big/small notice→request p50 {ratio(big.notice, small.notice, 0.5)}, "
            f"p95 {ratio(big.notice, small.notice, 0.95)}"
        )
    # The goals are the measured operator's (the first); --compare-src's is the code it is compared with.
    big = results[0][1]
    targets = Targets()
    # No notice measured at scale is a missed goal (NaN), not a met one.
    p95 = pct(big.notice, 0.95) if big.notice else math.nan
    targets.at_most(f"{big.label}, {big.jobs} jobs on {big.nodes} nodes: notice → request p95 s", p95, 2.0)
    targets.at_most(
        f"{big.label}, {big.jobs} jobs: the operator's peak memory / the chart's limit", big.peak_mib / limit, 1.0
    )
    targets.report(check)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=500, help="RLJobs at scale")
    p.add_argument("--nodes", type=int, default=2000, help="fleet Nodes at scale (≥ --jobs)")
    p.add_argument("--small-jobs", type=int, default=10, help="RLJobs of the baseline")
    p.add_argument("--small-nodes", type=int, default=10, help="fleet Nodes of the baseline (≥ --small-jobs)")
    p.add_argument("--rounds", type=int, default=20, help="single notices per scale")
    p.add_argument("--burst", type=int, default=50, help="nodes tainted at once (at most the jobs)")
    p.add_argument("--window", type=float, default=30, help="seconds of each steady-state window")
    p.add_argument("--seed", type=int, default=None, help="random seed (which jobs get the notices)")
    p.add_argument("--operator-args", default="", help='extra operator flags, e.g. "--reconcile-interval 2"')
    p.add_argument("--operator-src", type=Path, default=None, help="run the operator of this checkout")
    p.add_argument("--compare-src", type=Path, default=None, help="measure again with this checkout's operator")
    add_check(p)
    args = p.parse_args(argv)
    if args.nodes < args.jobs or args.small_nodes < args.small_jobs:
        p.error("every job needs a node of its own: --nodes ≥ --jobs, --small-nodes ≥ --small-jobs")
    if args.seed is None:
        args.seed = random.randrange(2**31)
    sources = [args.operator_src, *([args.compare_src] if args.compare_src else [])]
    sources = [s.resolve() if s else None for s in sources]
    print(f"seed {args.seed}; operator args: {args.operator_args or '(defaults)'}", flush=True)

    limit = chart_memory_limit_mib()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-operator-scale-") as tmp:
        workdir = Path(tmp)
        timings = Timings(node_monitor_grace_period=3600)
        cluster = Cluster(
            workdir / "cluster", nodes=[NodeSpec("ondemand-a", capacity_type="on-demand")], timings=timings
        )
        cluster.start()
        try:
            cluster.install_crd(REPO / "crds" / "rljobs.spotrl.dev.yaml")
            time.sleep(5)
            args.quiet_rps = window(cluster.admin(), 10)[0]  # the bare control plane's own rate
            fleet = Fleet(cluster.admin())
            for src in sources:
                results.append(run_source(cluster, fleet, workdir, args, src))
        finally:
            cluster.stop()
    report(results, limit, args.check)
    return 0


if __name__ == "__main__":
    sys.exit(main())
