"""`spotrl controller`: the job's controller inside its pod (the operator starts it).

Reads who it is from the environment the operator sets (``SPOTRL_JOB``, ``SPOTRL_NAMESPACE``,
``SPOTRL_ATTEMPT``, ``SPOTRL_STORAGE``, ``SPOTRL_POD_IP``), reads its RLJob from the API
server, and runs it with the Kubernetes bridge: barrier requests arrive through the RLJob's
status, and steps and cuts are reported there. With ``spec.generation.workerPods`` its Ray
head listens on the pod's IP and its address goes to ``status.rayHead`` for the worker pods.

A pod made as the job's standby (``spec.standby``: its attempt is above ``status.attempt``)
warms up (imports, Ray, the generation workers, the policy), then waits, claiming and serving
nothing, until the operator writes its attempt onto the status; then it runs as the controller
(:mod:`~spotrl_runtime.controller.standby`).

Its HTTP endpoint is two listeners: GET /metrics (and /healthz) on the pod's IP, port 9400,
for Prometheus; /metrics, /status and POST /barrier on 127.0.0.1:8080, which only the pod
itself reaches, or you with ``kubectl port-forward pod/<pod> 8080``. ``--http-host 0.0.0.0``
exposes POST /barrier to whoever reaches the pod.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

from spotrl_runtime.commands import preflight
from spotrl_runtime.commands.preflight import UsageError

log = logging.getLogger(__name__)


def register(sub: Any) -> None:
    from spotrl_runtime.commands.run import add_controller_flags

    p = sub.add_parser(
        "controller",
        help="run a job's controller in its pod (started by the operator)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_controller_flags(p, http_port=8080, metrics_port=9400, metrics_host="$SPOTRL_POD_IP, else 0.0.0.0")
    p.set_defaults(func=run)


def _required(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise UsageError(f"${name} is not set; the operator sets it in the controller pod")
    return value


def _parse(rljob: dict[str, Any], namespace: str, name: str) -> Any:
    """The RLJob as the API server has it, checked; a :class:`UsageError` names what is wrong.
    Fields this version does not know (a newer CRD or operator wrote them) are skipped and said."""
    from spotrl_runtime.api.rljob import SpecError, read_stored_rljob

    try:
        job, skipped = read_stored_rljob(rljob)
    except SpecError as err:
        raise UsageError(f"RLJob {namespace}/{name}: " + "; ".join(f"{p}: {m}" for p, m in err.problems)) from None
    if skipped:
        log.warning("RLJob %s/%s: skipped fields this version does not know: %s", namespace, name, ", ".join(skipped))
    preflight.check_job_inputs(job, f"RLJob {namespace}/{name}")
    return job


def run(args: argparse.Namespace) -> int:
    from spotrl_runtime.commands.run import (
        controller_options,
        refused_early,
        refused_store,
        run_controller,
        start_ray_early,
    )
    from spotrl_runtime.controller.standby import StandbyStopped, stand_by, status_attempt
    from spotrl_runtime.storage import open_storage

    job_name, namespace = _required("SPOTRL_JOB"), os.environ.get("SPOTRL_NAMESPACE") or "default"
    storage, attempt_text = _required("SPOTRL_STORAGE"), _required("SPOTRL_ATTEMPT")
    if not (attempt_text.isascii() and attempt_text.isdigit() and int(attempt_text) >= 1):
        raise UsageError(f"$SPOTRL_ATTEMPT={attempt_text!r}: must be an integer >= 1 (the operator numbers attempts)")
    attempt = int(attempt_text)
    preflight.check_storage(storage, "$SPOTRL_STORAGE")
    pod_ip = os.environ.get("SPOTRL_POD_IP") or None
    if pod_ip is not None and not preflight.is_ip(pod_ip):
        raise UsageError(f"$SPOTRL_POD_IP={pod_ip!r}: must be an IP address (the operator sets it from status.podIP)")
    metrics_host = args.metrics_host or pod_ip or "0.0.0.0"
    preflight.check_listeners(args.http_host, args.http_port, metrics_host, args.metrics_port)

    from spotrl_runtime.controller.kube_bridge import KubeBridge

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bridge = KubeBridge(job_name, namespace, attempt)
    rljob = bridge.read_job()
    job = _parse(rljob, namespace, job_name)
    # Ray listens on the pod's IP (worker pods join there); the barrier endpoint does not.
    # spec.generation.workerPods: the workers are pods of their own that join this pod's Ray.
    ray_host, remote_workers = pod_ip or "127.0.0.1", job.spec.generation.worker_pods
    if status_attempt(rljob) >= attempt:  # not a standby: the cut to resume from is there already
        refused = refused_early(job, storage, args.resume)
        if refused is not None:
            bridge.stop()
            return refused
    prestart = start_ray_early(args, job, ray_host=ray_host, remote_workers=remote_workers)
    try:
        options = controller_options(args, job, storage, metrics_host=metrics_host)
        if status_attempt(rljob) < attempt:  # a standby (spec.standby): warm, then wait for its attempt
            try:
                promoted = stand_by(job, bridge, options, prestart)
            except StandbyStopped:
                print("spotrl: stopped while standing by (nothing to keep)", file=sys.stderr)
                return 143  # as a controller stopped by SIGTERM
            if promoted["metadata"].get("generation") != rljob["metadata"].get("generation"):
                # The spec changed while it waited: what it warmed up may not fit any more.
                job = _parse(promoted, namespace, job_name)
                prestart.close()
                prestart = start_ray_early(args, job, ray_host=ray_host, remote_workers=remote_workers)
                options = controller_options(args, job, storage, metrics_host=metrics_host)
                options.started_at = time.time()
            # Promoted: from now on the store's writer, so its store is probed as any controller's.
            refused = refused_store(open_storage(storage))
            if refused is not None:
                return refused
        options.prestart = prestart
        options.attempt = attempt
        options.ray_host = ray_host
        options.remote_workers = remote_workers
        options.on_ready.append(lambda c: bridge.note_start(c.parts.times, c.parts.audit))
        options.on_ready.append(bridge.start)
        options.on_ray_head.append(bridge.publish_ray_head)
        options.sinks.insert(0, bridge)
        # A port taken in the pod (a sidecar) costs the endpoint, not the run: barriers come
        # through the RLJob, and the warning says what is missing.
        return run_controller(job, options, listeners_required=False)
    finally:
        prestart.close()  # nothing, once the controller took it
        bridge.stop()
