"""`spotrl worker --address HOST:PORT`: a Ray node of its own that joins a job's controller,
one per worker pod or trainer pod.

With ``spec.generation.workerPods`` the operator starts this in each worker pod, and with
``spec.training.parallelism.trainerPods`` (``--role trainer``) in each trainer pod, with the
address the controller published in ``status.rayHead``. It joins the controller's Ray
cluster as a node of its own: bound to this pod's address (``SPOTRL_POD_IP``, never
0.0.0.0: pods may share a host), every port chosen by Ray, offering the pod's CPUs and GPUs
and one unit of the resource of its role: ``spotrl.dev/worker`` (exactly one generation
worker actor of the controller's pool lands here and none anywhere else) or
``spotrl.dev/trainer`` (exactly one trainer rank's placement-group bundle).

SIGTERM (the pod is deleted, its node drains) stops the node's Ray processes and exits 143;
nothing of it keeps running. If the Ray node stops by itself (the controller and its head
went away) it exits 1 and says why; the operator starts pods for the next controller.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any

from spotrl_runtime.commands import preflight
from spotrl_runtime.processes import kill_descendants

ROLES = ("worker", "trainer")
"""What a node offers: one generation worker slot, or one trainer rank's slot."""
STOP_SECONDS = 8.0
"""After SIGTERM, how long Ray's own shutdown may take before its processes are killed."""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "worker",
        help="join a job's Ray cluster as a generation worker or trainer node (the operator starts it in worker "
        "and trainer pods)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--address",
        required=True,
        type=preflight.host_port,
        help="the controller's Ray head, HOST:PORT (status.rayHead.address)",
    )
    p.add_argument(
        "--node-ip", type=preflight.ip_address, help="this node's address (default: $SPOTRL_POD_IP, else 127.0.0.1)"
    )
    p.add_argument(
        "--role",
        choices=ROLES,
        default="worker",
        help="worker (default): offer one generation worker slot; trainer: offer one trainer rank's slot",
    )
    p.add_argument("--num-cpus", type=preflight.positive_int, help="CPUs this node offers (default: what Ray sees)")
    p.add_argument("--num-gpus", type=preflight.count, help="GPUs this node offers (default: what Ray sees)")
    p.set_defaults(func=run)


def ray_start_argv(
    address: str, node_ip: str, temp_dir: str, num_cpus: int | None, num_gpus: int | None, role: str = "worker"
) -> list[str]:
    """The `ray start` that joins ``address`` as a node of ``role`` (blocking until stopped)."""
    from spotrl_runtime.generation.cluster import TRAINER_RESOURCE, WORKER_RESOURCE

    resource = {"worker": WORKER_RESOURCE, "trainer": TRAINER_RESOURCE}[role]
    argv = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--address",
        address,
        "--node-ip-address",
        node_ip,
        "--resources",
        json.dumps({resource: 1}),
        "--temp-dir",
        temp_dir,
        # Ray picks free ports (two pods on one host must not both take a fixed one).
        "--dashboard-agent-listen-port",
        "0",
        "--min-worker-port",
        "0",
        "--max-worker-port",
        "0",
        "--disable-usage-stats",
        "--block",
    ]
    if num_cpus is not None:
        argv += ["--num-cpus", str(num_cpus)]
    if num_gpus is not None:
        argv += ["--num-gpus", str(num_gpus)]
    return argv


def _prctl(option: int, value: int) -> None:
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(option, value, 0, 0, 0)


def _die_with_parent() -> None:
    """In the child: SIGKILL it when this process dies (a SIGKILLed pod leaves no Ray behind)."""
    _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def run(args: argparse.Namespace) -> int:
    node_ip = args.node_ip or os.environ.get("SPOTRL_POD_IP") or "127.0.0.1"
    if node_ip in ("0.0.0.0", "::"):
        print("spotrl worker: --node-ip must be this pod's own address, not a wildcard", file=sys.stderr)
        return 2
    # Ray's unix sockets must fit in 107 bytes: a short private folder.
    temp_dir = tempfile.mkdtemp(prefix="ray-w-", dir=os.environ.get("SPOTRL_RAY_TMP", "/tmp"))
    env = {
        **os.environ,
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
        "RAY_USAGE_STATS_ENABLED": "0",
        # No drain wait on SIGTERM: a worker holds nothing (its groups go back to the pool); a
        # trainer rank that goes is a preemption of the trainer group, which no wait here saves.
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
    }
    argv = ray_start_argv(args.address, node_ip, temp_dir, args.num_cpus, args.num_gpus, args.role)
    print(f"spotrl worker: joining the Ray head at {args.address} as {args.role} node {node_ip}", flush=True)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # Ray's agents outlive a raylet that is gone, and its workers start sessions of their own:
    # as a subreaper this process inherits whatever they leave, and stops all of it.
    _prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    proc = subprocess.Popen(argv, env=env, preexec_fn=_die_with_parent)
    try:
        while proc.poll() is None and not stop.is_set():
            stop.wait(0.5)
        if stop.is_set():
            print("spotrl worker: SIGTERM; stopping the Ray node", flush=True)
            _stop(proc)
            return 143
        print(
            f"spotrl worker: the Ray node stopped by itself (exit code {proc.returncode}); the controller's head "
            f"at {args.address} is gone or unreachable",
            file=sys.stderr,
            flush=True,
        )
        return 1
    finally:
        _stop(proc)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Ray's own shutdown first (SIGTERM: it stops the raylet and its workers), then SIGKILL to
    every process still below this one (agents, workers), and reaps them."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(STOP_SECONDS)
    kill_descendants(between=lambda: _reap(timeout=2.0))
    if proc.poll() is None:
        proc.kill()
        proc.wait(5)


def _reap(timeout: float) -> None:
    """Collects exited children (orphans handed to this subreaper included)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.05)
