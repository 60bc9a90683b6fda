"""Runs the operator: wait for the leader Lease, then run Kopf until stopped or the Lease is lost.

A standby replica blocks in :meth:`LeaderElector.acquire` and serves nothing; the leader
runs Kopf with the handlers of :mod:`spotrl_operator.handlers`. Every write it sends is
fenced by the Lease (:meth:`LeaderElector.guard`). A leader that cannot renew stops Kopf
(SIGTERM to itself) and exits 1 (its Deployment restarts it as a standby), hard if Kopf has
not stopped in time, before a standby may take over; one that stops normally releases the
Lease so a standby takes over at once, in this order (:func:`_shut_down`): Kopf stopped first
(its own patches do not pass the guard), then the guard closed, then the calls still under way
in the worker threads waited for (bounded), then the Lease released.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from spotrl_operator.settings import Settings

log = logging.getLogger("spotrl.operator")


def run(settings: Settings) -> int:
    """Blocks until the operator stops; returns the process's exit code."""
    _configure_logging(settings)
    if settings.kubeconfig:
        os.environ["KUBECONFIG"] = settings.kubeconfig  # Kopf's own login reads it

    from spotrl_operator.metrics import Metrics
    from spotrl_runtime.kube import Kube

    kube = Kube.connect(settings.kubeconfig, qps=settings.kube_qps, burst=settings.kube_burst)
    metrics = Metrics()
    if settings.metrics_port:  # a standby serves its metrics too (spotrl_operator_leader 0)
        metrics.serve(settings.metrics_port, settings.metrics_address)
        log.info("metrics on http://%s:%d/metrics", settings.metrics_address, settings.metrics_port)
    renewing = threading.Event()  # set: stop renewing
    lost = threading.Event()
    elector = None
    if settings.leader_election:
        elector = _lead(settings, kube, renewing, lost, metrics.beating)
        if elector is None:
            log.info("stopped while standing by")
            return 0
        metrics.leader.set(1)
        kube = kube.with_guard(elector.guard)
    import spotrl_operator.handlers as handlers  # registers the handlers with Kopf

    ctx = handlers.Context(settings=settings, kube=kube, metrics=metrics)
    try:
        _run_kopf(settings, ctx)
    finally:
        metrics.leader.set(0)
        if lost.is_set():
            renewing.set()
        else:
            _shut_down(elector, ctx, renewing, settings.lease_seconds)
    if lost.is_set():
        log.error("exiting: the leader Lease was lost")
        return 1
    return 0


def _shut_down(elector: Any, ctx: Any, renewing: threading.Event, drain_seconds: float) -> None:
    """A clean stop, once Kopf has stopped (no handler starts, Kopf writes no more): close the
    guard (no write of ours is sent any more), wait up to ``drain_seconds`` for the calls still
    under way in the worker threads, still renewing the Lease so that no standby leads
    meanwhile, then stop renewing and release it: a standby leads at once, alone."""
    if elector is not None:
        elector.close()
    if ctx is not None and not ctx.drain(drain_seconds):
        log.warning("calls to the API server still under way after %.0f s; releasing the lease", drain_seconds)
    renewing.set()
    if elector is not None:
        elector.release()


def _configure_logging(settings: Settings) -> None:
    logging.basicConfig(
        level=logging.DEBUG if settings.verbose else logging.INFO,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
    )
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1` prints every thread's stack
    if not settings.verbose:
        # Kopf logs every handler call at INFO; keep its warnings and errors, and our own lines.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    if settings.log_writes:
        logging.getLogger("spotrl.kube.writes").setLevel(logging.DEBUG)


def _lead(
    settings: Settings, kube: Any, renewing: threading.Event, lost: threading.Event, beat: Callable[[], None]
) -> Any:
    """Stands by until this replica holds the Lease, then keeps renewing it (until ``renewing``
    is set); the elector, or None if a signal ended the wait. Losing the Lease sets ``lost``
    and stops the process."""
    from spotrl_operator.leader import STOP_SHARE, LeaderElector

    standby_stop = threading.Event()

    def stop_standing_by(signum: int, frame: FrameType | None) -> None:
        standby_stop.set()

    previous = {s: signal.signal(s, stop_standing_by) for s in (signal.SIGTERM, signal.SIGINT)}
    # The Lease's calls fail within their deadline instead of retrying: a renewal that hangs
    # must not outlive the leader's right to act. Three tries fit before it must stop.
    lease_kube = kube.for_deadline(max(1.0, settings.lease_seconds * STOP_SHARE / 3))
    elector = LeaderElector(
        lease_kube, settings.lease_namespace, settings.lease_name, settings.identity, settings.lease_seconds
    )
    leading = elector.acquire(standby_stop, beat)
    for s, handler in previous.items():
        signal.signal(s, handler)
    if not leading:
        return None

    def on_lost() -> None:
        # Kopf stops gracefully on SIGTERM (its own handler). A stop flag would leave a
        # thread blocked in Kopf's flag waiter when it stops for a signal instead.
        lost.set()
        _exit_hard_in(elector.exit_in())
        os.kill(os.getpid(), signal.SIGTERM)

    elector.keep(renewing, on_lost)
    return elector


def _exit_hard_in(seconds: float) -> None:
    """Exits 1 after ``seconds`` unless the process ended first: Kopf's graceful stop waits for
    handlers that may hang on the API server, and a standby will not wait for them."""

    def exit_now() -> None:
        log.error("exiting hard: Kopf did not stop within %.1f s of losing the lease", seconds)
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(seconds, exit_now)
    timer.daemon = True
    timer.start()


def _run_kopf(settings: Settings, ctx: Any) -> None:
    """Runs the handlers, with ``ctx`` (the handlers' Context), until Kopf stops (SIGTERM, or
    the Lease lost)."""
    import kopf

    import spotrl_operator.handlers as handlers

    handlers.register_children(settings)
    if settings.kueue:
        handlers.register_kueue()

    memo = kopf.Memo(ctx=ctx)
    ready = threading.Event()

    def say_ready() -> None:
        if ready.wait():
            where = ", ".join(settings.namespaces) or "all namespaces"
            log.info("ready: running RLJobs in %s as %s", where, settings.identity)

    threading.Thread(target=say_ready, name="ready-log", daemon=True).start()
    kopf.run(
        standalone=True,
        clusterwide=not settings.namespaces,
        namespaces=settings.namespaces,
        memo=memo,
        ready_flag=ready,
    )
