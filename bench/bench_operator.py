"""Operator latencies on the test control plane (real API server, controllers, node agent).

    PYTHONPATH=e2e python bench/bench_operator.py [--jobs 1,10,100] [--extra-nodes 0,20]
                                                  [--rounds 5] [--preemptions 5] [--standby both]

1. **signal → barrier request**, and how it grows with the number of RLJobs and of nodes
   the operator watches. N RLJobs whose controller pods idle on node spot-a: the bench
   places a ``sleep`` pod with each job's controller name and labels there before the job
   exists, so the operator adopts it as the job's running controller. (They never answer:
   only request latency is measured here.) At t0 the bench taints spot-a with
   ``karpenter.sh/disrupted``; for each job, the latency is when a watch on the RLJobs
   shows ``status.barrier.state == Requested``. Extra nodes come from the node agent and
   heartbeat like the others (each heartbeat is an event the operator handles).
2. **repeated preemptions with the real controller** (needs ``spotrl controller``): the
   tiny job on the spot nodes, a notice + drain of the controller's node, K times:
   signal → request, request → committed cut, eviction (the old controller's deletion)
   → the fresh controller's first trained step, as the bench sees them; and the phase
   table: the median and p95 of each phase of ``status.lastRecovery`` (what the operator
   and the controller recorded: notice → requested → committed → old pod deleted → fresh pod
   scheduled → process started → cut restored → generation ready → first trained step).
   ``--standby both`` (the default) runs this twice in turn, without ``spec.standby`` and
   with it (each notice then comes once the next attempt's standby is warm), prints the
   second's eviction → first step as a ratio of the first's, and what the waiting standby
   costs: its CPU over 10 s and its memory (PSS), summed over its processes.

The operator runs as ``python -m spotrl_operator`` (admin kubeconfig, no leader election,
reconcile interval 2 s), so the figures include its real watch and write paths.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from _operator_bench import idle_pod, pct
from spotrl_e2e.cluster import Cluster
from spotrl_e2e.kube import KubeClient, path
from spotrl_e2e.nodeagent.config import NodeSpec
from spotrl_e2e.procs import Process, free_port

REPO = Path(__file__).resolve().parents[1]
RLJOBS = "spotrl.dev/v1alpha1"
TAINT = "karpenter.sh/disrupted"
Obj = dict[str, Any]


def fmt(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"{statistics.median(values) * 1000:7.0f} {pct(values, 0.95) * 1000:7.0f} {max(values) * 1000:7.0f}"


class Watcher:
    """Records, per RLJob of a namespace, when a watch first shows ``predicate(status)``."""

    def __init__(self, admin: KubeClient, namespace: str, predicate: Callable[[Obj], bool]):
        self.admin, self.ns, self.predicate = admin, namespace, predicate
        self.seen: dict[str, float] = {}
        self.stop = False
        listing = admin.get(path(RLJOBS, "rljobs", namespace))
        self.rv = listing["metadata"]["resourceVersion"]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop:
            for event in self.admin.watch(
                path(RLJOBS, "rljobs", self.ns), self.rv, timeout_seconds=30, stop=lambda: self.stop
            ):
                obj = event["object"]
                self.rv = obj["metadata"]["resourceVersion"]
                name = obj["metadata"]["name"]
                if name not in self.seen and self.predicate(obj.get("status") or {}):
                    self.seen[name] = time.monotonic()

    def close(self) -> None:
        self.stop = True


def rljob(name: str, **spec: Any) -> Obj:
    base = {
        "policy": {"model": "builtin:tiny-arith"},
        "dataset": {"uri": "builtin:arithmetic"},
        "reward": {"name": "arithmetic_exact"},
        "training": {"totalSteps": 1000, "microBatchSize": 8},
        "checkpoint": {"storage": f"s3://bench-bucket/{name}"},
    }
    base.update(spec)
    return {"apiVersion": RLJOBS, "kind": "RLJob", "metadata": {"name": name}, "spec": base}


def start_operator(cluster: Cluster, workdir: Path) -> Process:
    port = free_port()
    argv = [
        sys.executable, "-m", "spotrl_operator", "--kubeconfig", str(cluster.kubeconfig), "--no-leader-election",
        "--metrics-address", "127.0.0.1", "--metrics-port", str(port), "--reconcile-interval", "2",
    ]  # fmt: skip
    op = Process("operator", argv, workdir).start()
    op.wait_ready(lambda: "ready: running RLJobs" in op.log.read_text(), 60, "ready")
    return op


def signal_round(cluster: Cluster, n: int) -> list[float]:
    """One round: n jobs with idle controllers on spot-a, a notice taint, the request latencies."""
    admin = cluster.admin()
    ns = cluster.create_namespace(f"bench-{n}")
    names = [f"j{i:03d}" for i in range(n)]
    for name in names:
        admin.create(path("v1", "pods", ns), idle_pod(name, "spot-a"))
    for name in names:
        admin.create(path(RLJOBS, "rljobs", ns), rljob(name))
    deadline = time.monotonic() + 60 + n
    while True:
        items = admin.get(path(RLJOBS, "rljobs", ns))["items"]
        running = [j for j in items if (j.get("status") or {}).get("phase") == "Running"]
        if len(running) == n:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(running)} of {n} jobs Running")
        time.sleep(0.5)
    time.sleep(2)  # let the operator settle (its periodic passes find nothing to do)
    watcher = Watcher(admin, ns, lambda st: (st.get("barrier") or {}).get("state") == "Requested")
    time.sleep(0.5)
    t0 = time.monotonic()
    cluster.taint("spot-a", TAINT, "true")
    deadline = time.monotonic() + 30 + n
    while len(watcher.seen) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    watcher.close()
    latencies = [watcher.seen[name] - t0 for name in names if name in watcher.seen]
    if len(latencies) < n:
        print(f"  warning: {n - len(latencies)} of {n} jobs got no barrier request within the wait", file=sys.stderr)
    cluster.untaint("spot-a", TAINT)
    for name in names:
        admin.delete(path(RLJOBS, "rljobs", ns, name))
    deadline = time.monotonic() + 60 + n
    while admin.get(path(RLJOBS, "rljobs", ns))["items"] and time.monotonic() < deadline:
        time.sleep(0.5)
    cluster.delete_namespace(ns)
    return latencies


def bench_signals(cluster: Cluster, jobs: list[int], extra_nodes: list[int], rounds: int) -> list[tuple[str, ...]]:
    rows = []
    added = 0
    for extra in extra_nodes:
        while added < extra:
            cluster.add_node(NodeSpec(f"extra-{added:02d}", capacity_type="on-demand"))
            added += 1
        for n in jobs:
            all_samples: list[float] = []
            firsts, lasts = [], []
            for _ in range(rounds if n < 100 else max(1, rounds // 2)):
                lat = signal_round(cluster, n)
                all_samples += lat
                if lat:
                    firsts.append(min(lat))
                    lasts.append(max(lat))
            nodes = 3 + extra
            rows.append(
                (f"{n:4d} jobs, {nodes:3d} nodes", fmt(all_samples), fmt(firsts), fmt(lasts), str(len(all_samples)))
            )
            print("  ", " | ".join(rows[-1]), flush=True)
    return rows


# --------------------------------------------------------------------------- with the real controller


def controller_exists() -> bool:
    out = subprocess.run([sys.executable, "-m", "spotrl_runtime.cli", "--help"], capture_output=True, text=True)
    return " controller " in out.stdout


PHASES = (
    ("noticeToRequested", "1 notice → requested"),
    ("requestedToCommitted", "2 requested → committed"),
    ("committedToDeleted", "3 committed → pod deleted"),
    ("deletedToScheduled", "  deleted → scheduled"),
    ("scheduledToStarted", "4 scheduled → started"),
    ("startedToRestored", "5 started → restored"),
    ("restoredToReady", "6 restored → gen. ready"),
    ("readyToFirstStep", "7 ready → first step"),
)


def pod_log(cluster: Cluster, ns: str, pod: str) -> str:
    """The pod's log so far ("" before it has one)."""
    try:
        return cluster.pod_log(ns, pod)
    except Exception:  # not created or not started yet
        return ""


def standby_cost(pod: str, seconds: float = 10.0) -> tuple[float, float]:
    """(CPU cores used, MiB of memory) of a waiting standby: every process on this machine that
    runs for ``pod`` (the node agent runs pods as local processes; Ray's inherit the pod's
    environment), its CPU time over ``seconds`` and its proportional set size (shared pages
    split among the processes that map them, so the libraries Ray's processes share count once)."""
    tick = os.sysconf("SC_CLK_TCK")

    def processes() -> dict[int, tuple[float, int]]:
        out = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if f"SPOTRL_POD_NAME={pod}".encode() not in (entry / "environ").read_bytes().split(b"\0"):
                    continue
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                rollup = (entry / "smaps_rollup").read_text().splitlines()
                pss = next(int(line.split()[1]) for line in rollup if line.startswith("Pss:")) * 1024
                out[int(entry.name)] = ((int(fields[11]) + int(fields[12])) / tick, pss)
            except (OSError, ValueError, IndexError, StopIteration):
                continue
        return out

    before = processes()
    time.sleep(seconds)
    after = processes()
    cpu = sum(t - before[pid][0] for pid, (t, _) in after.items() if pid in before)
    return cpu / seconds, sum(pss for _, pss in after.values()) / 2**20


def bench_preemptions(
    cluster: Cluster, s3: Any, preemptions: int, standby: bool = False
) -> tuple[dict[str, list[float]], dict[str, list[float]], tuple[float, float] | None]:
    """The tiny job preempted K times (notice taint + drain): the three latencies the bench
    sees per preemption, and each phase of ``status.lastRecovery`` (with its total). With
    ``standby`` (``spec.standby``), each notice comes once the next attempt's standby is warm,
    and what the standby costs while it waits (CPU cores, MiB of memory) is measured before the
    first (else None)."""
    admin = cluster.admin()
    ns = cluster.create_namespace("bench-standby" if standby else "bench-preempt")
    admin.create(
        path("v1", "secrets", ns),
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "s3"},
            "stringData": {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key},
        },
    )
    job = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    job["spec"]["training"]["totalSteps"] = 10_000
    job["spec"]["checkpoint"].update(
        {
            "storage": f"s3://{s3.bucket}/{'tiny-standby' if standby else 'tiny'}",
            "s3Endpoint": s3.endpoint,
            "credentialsSecret": "s3",
        }
    )
    job["spec"]["scheduling"]["nodeSelector"] = {"karpenter.sh/capacity-type": "spot"}
    job["spec"]["standby"] = standby
    admin.create(path(RLJOBS, "rljobs", ns), job)
    url = path(RLJOBS, "rljobs", ns, "tiny-arith")

    def status() -> Obj:
        return dict(admin.get(url).get("status") or {})

    def wait(check: Callable[[Obj], bool], timeout: float) -> tuple[Obj, float]:
        deadline = time.monotonic() + timeout
        while True:
            st = status()
            if check(st):
                return st, time.monotonic()
            if time.monotonic() > deadline:
                raise TimeoutError(json.dumps(st)[:2000])
            time.sleep(0.05)

    out: dict[str, list[float]] = {"signal → request": [], "request → committed cut": [], "eviction → first step": []}
    phases: dict[str, list[float]] = {}
    cost: tuple[float, float] | None = None
    for k in range(preemptions):
        attempt = k + 1
        st, _ = wait(lambda s, a=attempt: s.get("stepAttempt") == a and (s.get("step") or 0) >= 1, 600)
        if standby:
            following = f"tiny-arith-controller-{attempt + 1}"
            deadline = time.monotonic() + 300
            while f"waiting for status.attempt to reach {attempt + 1}" not in pod_log(cluster, ns, following):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"standby {following} not warm: {pod_log(cluster, ns, following)[-2000:]}")
                time.sleep(0.2)
            if k == 0:
                cost = standby_cost(following)
        node = st["controllerNode"]
        t0 = time.monotonic()
        cluster.taint(node, TAINT, "true")
        _, t_req = wait(lambda s: (s.get("barrier") or {}).get("state") in ("Requested", "Committed"), 60)
        drain = cluster.drain(node, timeout=300)
        _, t_commit = wait(lambda s: (s.get("barrier") or {}).get("state") == "Committed", 120)
        old = f"{st['controllerPod']}"
        pod_url = path("v1", "pods", ns, old)
        t_evict = None
        while t_evict is None:
            pod = admin.get_or_none(pod_url)
            if pod is None or pod["metadata"].get("deletionTimestamp"):
                t_evict = time.monotonic()
            time.sleep(0.02)
        _, t_step = wait(lambda s, a=attempt + 1: s.get("stepAttempt") == a, 600)
        st, _ = wait(lambda s, a=attempt + 1: (s.get("lastRecovery") or {}).get("attempt") == a, 60)
        recovered = st["lastRecovery"]
        if standby and not recovered.get("standby"):
            raise AssertionError(f"attempt {attempt + 1} did not start from the standby: {recovered}")
        for key, label in PHASES:
            value = (recovered.get("phases") or {}).get(key)
            if value is not None:
                phases.setdefault(label, []).append(float(value))
        if recovered.get("totalSeconds") is not None:
            phases.setdefault("total", []).append(float(recovered["totalSeconds"]))
        drain.wait(300)
        cluster.untaint(node, TAINT)
        cluster.uncordon(node)
        out["signal → request"].append(t_req - t0)
        out["request → committed cut"].append(t_commit - t_req)
        out["eviction → first step"].append(t_step - t_evict)
        print(f"  preemption {attempt}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in out.items()), flush=True)
    admin.delete(url)
    return out, phases, cost


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", default="1,10,100", help="numbers of RLJobs (comma-separated)")
    p.add_argument("--extra-nodes", default="0,20", help="extra nodes watched (comma-separated, increasing)")
    p.add_argument("--rounds", type=int, default=5, help="notice rounds per configuration")
    p.add_argument("--preemptions", type=int, default=5, help="preemptions of the tiny job (needs the controller)")
    p.add_argument(
        "--standby",
        choices=("both", "off", "on"),
        default="both",
        help="preempt the tiny job without spec.standby, with it, or both in turn (default: both, the baseline first)",
    )
    args = p.parse_args(argv)
    jobs = [int(x) for x in args.jobs.split(",") if x]
    extra_nodes = [int(x) for x in args.extra_nodes.split(",") if x]
    modes = {"both": (False, True), "off": (False,), "on": (True,)}[args.standby]

    from spotrl_e2e.s3 import S3Server

    results: list[tuple[bool, dict[str, list[float]], dict[str, list[float]], tuple[float, float] | None]] = []
    with tempfile.TemporaryDirectory(prefix="bench-operator-") as tmp:
        workdir = Path(tmp)
        cluster = Cluster(workdir / "cluster").start()
        s3 = None
        op = None
        try:
            cluster.install_crd(REPO / "crds" / "rljobs.spotrl.dev.yaml")
            op = start_operator(cluster, workdir)
            print("signal → barrier request (ms: median p95 max)", flush=True)
            rows = bench_signals(cluster, jobs, extra_nodes, args.rounds)
            if args.preemptions and controller_exists():
                s3 = S3Server(workdir / "s3").start()
                bucket = s3.create_bucket("bench")
                for standby in modes:
                    print(f"repeated preemptions of the tiny job, spec.standby {str(standby).lower()}", flush=True)
                    results.append((standby, *bench_preemptions(cluster, bucket, args.preemptions, standby)))
        finally:
            if op is not None:
                op.stop()
            if s3 is not None:
                s3.stop()
            cluster.stop()

    print()
    print("signal → barrier request, all jobs of a round (ms)")
    print(f"{'':>22} | {'all: med   p95   max':>23} | {'first job of a round':>23} | {'last job of a round':>23} | n")
    for row in rows:
        print(" | ".join(row))
    print()
    if not results:
        print("repeated preemptions with the real controller: n/a (`spotrl controller` is not there yet)")
    baseline = None
    for standby, preempt, phases, cost in results:
        print(f"repeated preemptions with the real controller, spec.standby {str(standby).lower()} (s: median, p95)")
        for what, values in preempt.items():
            print(f"  {what:<26} {statistics.median(values):6.2f} {pct(values, 0.95):6.2f}  (n={len(values)})")
        first_step = statistics.median(preempt["eviction → first step"])
        if baseline is None:
            baseline = first_step
        else:
            print(f"  eviction → first step against spec.standby false: {first_step / baseline:.2f}x")
        if cost is not None:
            print(f"  the waiting standby: {cost[0]:.3f} CPU cores, {cost[1] / 1024:.2f} GiB (PSS)")
        print("where the seconds go: status.lastRecovery phases (s: median, p95)")
        for label, values in phases.items():
            print(f"  {label:<26} {statistics.median(values):6.2f} {pct(values, 0.95):6.2f}  (n={len(values)})")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
