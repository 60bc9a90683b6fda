"""Kueue's eviction → the committed barrier cut, against a node notice → the committed cut, in
one run on the test control plane (real API server, Kueue v0.17 built from its Go module, the
operator with ``--kueue``, the real controller on S3).

    PYTHONPATH=e2e python bench/bench_kueue.py [--rounds 3]

One ClusterQueue with quota for one tiny job. Each round:

1. **a node notice** (the baseline): the low-priority job trains; the bench taints its node
   with ``karpenter.sh/disrupted`` and times notice → barrier committed (the job moves to the
   other spot node; the taint is then taken off);
2. **Kueue's preemption**: a high-priority job is created; the bench times the low job's
   Workload turning ``Evicted`` → its barrier committed, and → its quota given back (its pods
   gone). The high job is deleted once admitted; the low job is admitted again and resumes.

Prints the medians and each Kueue figure as a ratio of the notice's in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from spotrl_e2e.cluster import Cluster
from spotrl_e2e.kube import path
from spotrl_e2e.kueue import LocalKueue, cluster_queue, local_queue, priority_class, resource_flavor
from spotrl_e2e.procs import Process, free_port
from spotrl_e2e.s3 import S3Server

REPO = Path(__file__).resolve().parents[1]
RLJOBS = "spotrl.dev/v1alpha1"
WORKLOADS = "kueue.x-k8s.io/v1beta2"
SPOT = {"karpenter.sh/capacity-type": "spot"}
Obj = dict[str, Any]


def wait(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> tuple[Any, float]:
    """Polls ``check`` until it returns something true: (that, when: monotonic)."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got, time.monotonic()
        if time.monotonic() > deadline:
            raise TimeoutError(f"waiting for {what}")
        time.sleep(interval)


def job(name: str, bucket: Any, priority: str) -> Obj:
    doc = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    doc["metadata"] = {
        "name": name,
        "labels": {"kueue.x-k8s.io/queue-name": "lq", "kueue.x-k8s.io/priority-class": priority},
    }
    doc["spec"]["training"]["totalSteps"] = 10_000
    doc["spec"]["checkpoint"].update(
        {"storage": f"s3://{bucket.bucket}/{name}", "s3Endpoint": bucket.endpoint, "credentialsSecret": "s3"}
    )
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    notice: list[float] = []
    evicted: list[float] = []
    released: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-kueue-") as tmp:
        work = Path(tmp)
        cluster = Cluster(work / "cluster").start()
        s3 = kueue = op = None
        try:
            cluster.tools.require("kueue", "kueue_manifests")
            assert cluster.tools.kueue is not None
            assert cluster.tools.kueue_manifests is not None
            cluster.install_crd(REPO / "crds" / "rljobs.spotrl.dev.yaml")
            kueue = LocalKueue(
                cluster, cluster.controlplane.pki, cluster.tools.kueue, cluster.tools.kueue_manifests, work
            )
            kueue.start()
            s3 = S3Server(work / "s3").start()
            bucket = s3.create_bucket("bench")
            argv_op = [
                sys.executable, "-m", "spotrl_operator", "--kubeconfig", str(cluster.kubeconfig), "--kueue",
                "--no-leader-election", "--metrics-port", str(free_port()), "--metrics-address", "127.0.0.1",
                "--reconcile-interval", "2",
            ]  # fmt: skip
            op = Process("operator", argv_op, work).start()
            op.wait_ready(lambda: "ready: running RLJobs" in op.log.read_text(), 60, "ready")
            ns = cluster.create_namespace("bench-kueue")
            admin = cluster.admin()
            secret = {"AWS_ACCESS_KEY_ID": bucket.access_key, "AWS_SECRET_ACCESS_KEY": bucket.secret_key}
            admin.create(path("v1", "secrets", ns), {"metadata": {"name": "s3"}, "stringData": secret})
            kueue.apply(
                resource_flavor("spot", SPOT),
                priority_class("low", 100),
                priority_class("high", 1000),
                cluster_queue("bench", "spot", cpu="750m", memory="6Gi"),
                local_queue(ns, "lq", "bench"),
            )
            low = path(RLJOBS, "rljobs", ns, "low")
            admin.create(path(RLJOBS, "rljobs", ns), job("low", bucket, "low"))

            def status() -> Obj:
                return dict(admin.get(low).get("status") or {})

            def workload_of(name: str) -> Obj | None:
                items = admin.get(path(WORKLOADS, "workloads", ns)).get("items") or []
                return next((w for w in items if w["metadata"]["ownerReferences"][0]["name"] == name), None)

            def cond(wl: Obj | None, ctype: str) -> str | None:
                conds = ((wl or {}).get("status") or {}).get("conditions") or []
                return next((c["status"] for c in conds if c["type"] == ctype), None)

            attempt = 1
            for r in range(args.rounds):
                st, _ = wait(
                    lambda a=attempt: (s := status()).get("stepAttempt") == a and s.get("step") and s, 600, "steps"
                )
                node = st["controllerNode"]
                t0 = time.monotonic()
                cluster.taint(node, "karpenter.sh/disrupted", "true")
                wait(lambda: (status().get("barrier") or {}).get("state") == "Committed", 120, "the notice's cut")
                notice.append(time.monotonic() - t0)
                attempt += 1
                wait(lambda a=attempt: status().get("stepAttempt") == a, 600, "the job moved")
                cluster.untaint(node, "karpenter.sh/disrupted")
                cluster.uncordon(node)

                admin.create(path(RLJOBS, "rljobs", ns), job("high", bucket, "high"))
                _, t_ev = wait(lambda: cond(workload_of("low"), "Evicted") == "True", 120, "Kueue's eviction")
                _, t_cut = wait(
                    lambda: (
                        (b := status().get("barrier") or {}).get("state") == "Committed"
                        and b.get("reason") == "kueue-eviction"
                    ),
                    120,
                    "the eviction's cut",
                )
                _, t_rel = wait(lambda: cond(workload_of("low"), "QuotaReserved") == "False", 120, "the quota back")
                evicted.append(t_cut - t_ev)
                released.append(t_rel - t_ev)
                print(f"  round {r + 1}: notice → cut {notice[-1]:.2f} s, Kueue eviction → cut {evicted[-1]:.2f} s, "
                      f"→ quota back {released[-1]:.2f} s", flush=True)  # fmt: skip
                wait(
                    lambda: (admin.get(path(RLJOBS, "rljobs", ns, "high")).get("status") or {}).get("step"), 600, "high"
                )
                admin.delete(path(RLJOBS, "rljobs", ns, "high"))
                wait(lambda: admin.get_or_none(path(RLJOBS, "rljobs", ns, "high")) is None, 120, "high gone")
                attempt += 1
        finally:
            for proc in (op, kueue, s3):
                if proc is not None:
                    proc.stop()
            cluster.stop()
    med_n, med_e, med_r = (statistics.median(v) for v in (notice, evicted, released))
    print()
    print(f"{'the tiny job, one ClusterQueue (s)':<44} | median | ratio to the notice")
    print(f"{'node notice → barrier committed (baseline)':<44} | {med_n:6.2f} | 1.00")
    print(f"{'Kueue eviction → barrier committed':<44} | {med_e:6.2f} | {med_e / med_n:.2f}")
    print(f"{'Kueue eviction → quota given back':<44} | {med_r:6.2f} | {med_r / med_n:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
