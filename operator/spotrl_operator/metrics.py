"""The operator's Prometheus metrics (``/metrics`` on ``--metrics-port``).

Counters are per process: a restarted or newly elected operator starts from zero, as
Prometheus expects of counters. The first-seen times behind the signal→barrier latency
are kept in memory only to measure; nothing decides on them. That memory is bounded, so
that spot churn does not grow the operator: a node's sightings go with the node (and any
after :data:`MEMORY_SECONDS`), a job's barriers and recoveries with the job (and all but
its last :data:`BARRIER_MEMORY` barriers before). No metric has a node, job or barrier label.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from spotrl_operator.recovery import phase_seconds
from spotrl_runtime.api.rljob import LastRecovery

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
RECOVERY_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
MEMORY_SECONDS = 600.0
"""A notice's sighting is forgotten this long after it (past the last latency bucket)."""
BARRIER_MEMORY = 4
"""The barriers of a job remembered (counted once each): an older one is never on its status again."""
JobKey = tuple[str, str]


class Metrics:
    """Every metric of one operator process, in its own registry."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.registry = CollectorRegistry()
        r = self.registry
        self.reconciles = Counter(
            "spotrl_operator_reconciles",
            "Reconcile passes over a job, by result (ok, conflict, error)",
            ["result"],
            registry=r,
        )
        self.barriers_requested = Counter(
            "spotrl_operator_barriers_requested", "Barrier cuts requested, by notice provider", ["provider"], registry=r
        )
        self.barriers_committed = Counter("spotrl_operator_barriers_committed", "Barrier cuts committed", registry=r)
        self.barriers_missed = Counter("spotrl_operator_barriers_missed", "Barriers past their deadline", registry=r)
        self.barriers_failed = Counter("spotrl_operator_barriers_failed", "Barriers the controller failed", registry=r)
        self.signal_to_barrier = Histogram(
            "spotrl_operator_signal_to_barrier_seconds",
            "From the operator seeing a notice to the barrier request written on the RLJob",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.barrier_to_commit = Histogram(
            "spotrl_operator_barrier_commit_seconds",
            "From the barrier request to the operator seeing it committed",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.recovery_phase = Histogram(
            "spotrl_operator_recovery_phase_seconds",
            "Seconds of each phase of a recovery from a preemption (status.lastRecovery.phases)",
            ["phase"],
            buckets=RECOVERY_BUCKETS,
            registry=r,
        )
        self.recovery_total = Histogram(
            "spotrl_operator_recovery_seconds",
            "From the notice (or the interruption) to the new attempt's first trained step",
            buckets=RECOVERY_BUCKETS,
            registry=r,
        )
        self.skipped_fields = Counter(
            "spotrl_operator_skipped_fields",
            "Passes that skipped fields of a stored RLJob this operator does not know (a newer CRD, operator or "
            "controller wrote them; the job's VersionSkew condition names them), by part (spec, status)",
            ["part"],
            registry=r,
        )
        self.controllers_created = Counter("spotrl_operator_controllers_created", "Controller pods created", registry=r)
        self.jobs = Gauge("spotrl_operator_jobs", "RLJobs by phase", ["phase"], registry=r)
        self.leader = Gauge("spotrl_operator_leader", "1 while this replica holds the lease", registry=r)
        self.pass_seconds = Histogram(
            "spotrl_operator_pass_seconds",
            "Duration of one pass over one job (observe, decide, write)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.pass_lag = Histogram(
            "spotrl_operator_pass_lag_seconds",
            "From an event waking a job to its pass starting (the queue's lag)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.unhealthy_nodes = Gauge(
            "spotrl_operator_unhealthy_nodes", "Nodes Ready Unknown or tainted unreachable", registry=r
        )
        self.force_deletes_paused = Gauge(
            "spotrl_operator_force_deletes_paused",
            "1 while force deletes are paused in some zone (too many of its nodes not Ready, or every zone down)",
            registry=r,
        )
        self.beat = time.monotonic()
        """When the operator's event loop last showed it runs (:meth:`alive`)."""
        self._lock = threading.Lock()
        self._first_seen: dict[tuple[str, str], float] = {}
        self._pruned_at = clock()
        self._barriers: dict[JobKey, OrderedDict[str, set[str]]] = {}
        """Per job, its last barriers' ids and the states counted for each ("requested" included)."""
        self._requested_at: dict[str, float] = {}
        self._phases: dict[JobKey, str] = {}
        self._recovered: dict[JobKey, int] = {}
        """Per job, the last attempt whose recovery was counted."""

    def state_size(self) -> int:
        """How many entries the in-memory state holds (a test's measure of it)."""
        with self._lock:
            barriers = sum(len(b) for b in self._barriers.values())
            tables = (self._first_seen, self._barriers, self._requested_at, self._phases, self._recovered)
            return barriers + sum(len(t) for t in tables)

    def serve(self, port: int, address: str) -> Any:
        """Starts the /metrics HTTP server in a thread, with ``/healthz`` for the liveness probe."""
        server, thread = start_http_server(port, addr=address, registry=self.registry)
        metrics = self
        app = server.get_app()
        assert app is not None  # prometheus_client's server always has one

        def healthz(environ: dict[str, Any], start_response: Any) -> Any:
            if environ.get("PATH_INFO") != "/healthz":
                return app(environ, start_response)
            ok, why = metrics.alive()
            start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [why.encode()]

        server.set_app(healthz)
        return server, thread

    STALL_SECONDS = 60.0
    """An event loop that has not beaten for this long is stuck: the liveness probe fails."""

    def alive(self) -> tuple[bool, str]:
        """Whether the process still works: its event loop beats (:meth:`beating`); a standby,
        which runs no loop, beats from its Lease loop."""
        silent = time.monotonic() - self.beat
        if silent > self.STALL_SECONDS:
            return False, f"the event loop has not run for {silent:.0f} s\n"
        return True, "ok\n"

    def beating(self) -> None:
        self.beat = time.monotonic()

    # ---------------------------------------------------------------- signal → barrier
    def signal_seen(self, node: str, reason: str) -> None:
        """A notice on ``node`` was first seen now (later sightings keep the first time)."""
        now = self.clock()
        with self._lock:
            self._first_seen.setdefault((node, reason), now)
            if now - self._pruned_at >= MEMORY_SECONDS / 10:  # a walk over the sightings now and then, not each time
                self._pruned_at = now
                for key in [k for k, t in self._first_seen.items() if now - t > MEMORY_SECONDS]:
                    del self._first_seen[key]

    def signal_gone(self, node: str) -> None:
        """The node has no notice any more, or is gone: its sightings are forgotten."""
        with self._lock:
            for key in [k for k in self._first_seen if k[0] == node]:
                del self._first_seen[key]

    def _first_count(self, job: JobKey, request_id: str, state: str) -> bool:
        """Whether ``state`` of the job's barrier ``request_id`` is new (and now remembered)."""
        barriers = self._barriers.setdefault(job, OrderedDict())
        states = barriers.setdefault(request_id, set())
        barriers.move_to_end(request_id)
        while len(barriers) > BARRIER_MEMORY:
            old, _ = barriers.popitem(last=False)
            self._requested_at.pop(old, None)
        if state in states:
            return False
        states.add(state)
        return True

    def barrier_requested(self, job: JobKey, request_id: str, node: str | None, reason: str, provider: str) -> None:
        now = self.clock()
        with self._lock:
            if not self._first_count(job, request_id, "requested"):
                return
            self._requested_at[request_id] = now
            seen = self._first_seen.get((node or "", reason))
        self.barriers_requested.labels(provider).inc()
        if seen is not None:
            self.signal_to_barrier.observe(now - seen)

    def barrier_answered(self, job: JobKey, request_id: str, state: str) -> None:
        """The job's barrier reached ``state`` (Committed, Missed, Failed); counted once per id."""
        with self._lock:
            if not self._first_count(job, request_id, state):
                return
            requested = self._requested_at.pop(request_id, None)
        if state == "Committed":
            self.barriers_committed.inc()
            if requested is not None:
                self.barrier_to_commit.observe(self.clock() - requested)
        elif state == "Missed":
            self.barriers_missed.inc()
        elif state == "Failed":
            self.barriers_failed.inc()

    def recovered(self, namespace: str, name: str, rec: LastRecovery) -> None:
        """A recovery was composed: its phases into the histograms, once per attempt."""
        with self._lock:
            if self._recovered.get((namespace, name), -1) >= rec.attempt:
                return
            self._recovered[(namespace, name)] = rec.attempt
        for label, seconds in phase_seconds(rec):
            self.recovery_phase.labels(label).observe(seconds)
        if rec.total_seconds is not None:
            self.recovery_total.observe(rec.total_seconds)

    def job_phase(self, namespace: str, name: str, phase: str | None) -> None:
        """Keeps the jobs-by-phase gauge (None: the job is gone)."""
        key = (namespace, name)
        with self._lock:
            old = self._phases.pop(key, None)
            if phase is not None:
                self._phases[key] = phase
        if old is not None:
            self.jobs.labels(old).dec()
        if phase is not None:
            self.jobs.labels(phase).inc()

    def job_gone(self, namespace: str, name: str) -> None:
        """The job is deleted (or no longer this replica's): its phase, barriers and recoveries forgotten."""
        self.job_phase(namespace, name, None)
        with self._lock:
            for request_id in self._barriers.pop((namespace, name), {}):
                self._requested_at.pop(request_id, None)
            self._recovered.pop((namespace, name), None)
