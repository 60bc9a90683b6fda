"""`spotrl controller`: the job's controller inside its pod (the operator starts it).

Reads who it is from the environment the operator sets (``SPOTRL_JOB``, ``SPOTRL_NAMESPACE``,
``SPOTRL_ATTEMPT``, ``SPOTRL_STORAGE``, ``SPOTRL_POD_IP``), reads its RLJob from the API
server, and runs it with the Kubernetes bridge: barrier requests arrive through the RLJob's
status, and steps and cuts are reported there. With ``spec.generation.workerPods`` its Ray
head listens on the pod's IP and its address goes to ``status.rayHead`` for the worker pods.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("controller", help="run a job's controller in its pod (started by the operator)")
    p.add_argument("--resume", default="auto", help="auto (default), never, or a cut id")
    p.add_argument("--http-port", type=int, default=8080, help="/metrics, /status and POST /barrier (default 8080)")
    p.add_argument("--sigterm-deadline", type=float, help="seconds a SIGTERM barrier cut may take")
    p.add_argument("--device", default="auto", help="auto (cuda when a GPU is visible), cpu, or cuda[:N]")
    p.set_defaults(func=run)


def _required(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise SystemExit(f"spotrl controller: {name} is not set; the operator sets it in the controller pod")
    return value


def run(args: argparse.Namespace) -> int:
    from spotrl_runtime.api.rljob import SpecError, parse_rljob
    from spotrl_runtime.commands.run import controller_options, run_controller
    from spotrl_runtime.controller.kube_bridge import KubeBridge

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    job_name, namespace = _required("SPOTRL_JOB"), os.environ.get("SPOTRL_NAMESPACE", "default")
    storage, attempt = _required("SPOTRL_STORAGE"), int(_required("SPOTRL_ATTEMPT"))
    bridge = KubeBridge(job_name, namespace, attempt)
    try:
        job = parse_rljob(bridge.read_job())
    except SpecError as err:
        print(f"RLJob {namespace}/{job_name}: {err}", file=sys.stderr)
        return 2
    options = controller_options(args, job, storage)
    options.attempt = attempt
    options.http_host = os.environ.get("SPOTRL_POD_IP") or "127.0.0.1"
    options.on_ready.append(bridge.start)
    # spec.generation.workerPods: the workers are pods of their own that join this pod's Ray.
    options.remote_workers = job.spec.generation.worker_pods
    options.on_ray_head.append(bridge.publish_ray_head)
    options.sinks.insert(0, bridge)
    try:
        return run_controller(job, options)
    finally:
        bridge.stop()
