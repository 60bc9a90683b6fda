"""One active operator among replicas: a coordination.k8s.io Lease.

Why not Kopf's peering: peers of equal priority pause each other (or both run), and the
replicas of one Deployment all get the same flags. A Lease is exclusive: one holder at a
time, standbys take over when it stops renewing (or at once when it releases on exit).

Expiry is judged the way client-go does it: a standby notes when it last saw the lease
*change* (by its own monotonic clock) and takes over when nothing changed for the
lease's duration, so the replicas' wall clocks need not agree.

A leader must stop acting before a standby can start, whatever its API calls do:

- its own Lease calls run on a client with a short deadline (a third of the time it may act
  unrenewed) and no retries (a renewal fails fast instead of waiting out urllib3 retries and
  Retry-After waits);
- :meth:`LeaderElector.leads` is judged from the clock alone: True only while the last
  renewal *sent* is younger than :data:`STOP_SHARE` of the lease. Every write the operator
  sends asks it first (:meth:`LeaderElector.guard`, the client's write guard), so a leader
  whose renewal hangs refuses its own writes by the clock, not when the call returns;
- a watchdog thread, which never blocks on a call, declares the loss at that moment
  (``on_lost``), and the process exits hard if it has not stopped :data:`EXIT_SHARE` of the
  lease later. A standby waits the whole lease from when it saw the last change.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from spotrl_runtime.api import times
from spotrl_runtime.kube import Kube, KubeError, NotLeadingError, path

log = logging.getLogger("spotrl.operator.leader")
Obj = dict[str, Any]

STOP_SHARE = 2 / 3
"""A leader whose last renewal is older than this share of the lease stops acting."""
EXIT_SHARE = 5 / 6
"""... and is gone (a hard exit) by this share: before a standby, which waits the whole lease."""
WATCH_SECONDS = 0.25


class LeaderElector:
    """Acquires and renews the Lease ``namespace/name`` as ``identity``."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str,
        identity: str,
        lease_seconds: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.kube = kube
        """The Lease's own client: give it a short deadline and no retries (:meth:`Kube.for_deadline`)."""
        self.url = path("coordination.k8s.io/v1", "leases", namespace, name)
        self.collection = path("coordination.k8s.io/v1", "leases", namespace)
        self.name = name
        self.identity = identity
        self.lease_seconds = lease_seconds
        self.retry_seconds = max(0.5, lease_seconds / 5)
        self.renew_seconds = max(0.5, lease_seconds / 7.5)
        """Renew every 2 s of a 15 s lease, as client-go does: several tries before :data:`STOP_SHARE`."""
        self.clock = clock
        self._seen: tuple[Any, ...] | None = None
        self._seen_at = 0.0
        self._last_renewal = -float("inf")
        self._sending_since = 0.0
        self._lost = False
        self._closed = False
        self.holder = ""
        """The holder seen last."""

    def _record(self, transitions: int, acquire: str | None) -> Obj:
        now = times.rfc3339_micro()
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(self.lease_seconds)),
            "acquireTime": acquire or now,
            "renewTime": now,
            "leaseTransitions": transitions,
        }

    def try_acquire_or_renew(self) -> bool:
        """One attempt; True when this replica holds the lease afterwards."""
        self._sending_since = self.clock()  # a renewal counts from when it was sent, not answered
        try:
            lease = self.kube.get_or_none(self.url)
            if lease is None:
                body = {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {"name": self.name},
                    "spec": self._record(0, None),
                }
                self.kube.create(self.collection, body)
                return self._held()
            spec = lease.get("spec") or {}
            holder = spec.get("holderIdentity") or ""
            self.holder = holder
            transitions = int(spec.get("leaseTransitions") or 0)
            if holder == self.identity:
                lease["spec"] = self._record(transitions, spec.get("acquireTime"))
                self.kube.update(self.url, lease)
                return self._held()
            now = self.clock()
            seen = (holder, spec.get("renewTime"), lease["metadata"].get("resourceVersion"))
            if seen != self._seen:
                self._seen, self._seen_at = seen, now
            duration = float(spec.get("leaseDurationSeconds") or self.lease_seconds)
            if holder and now - self._seen_at < duration:
                return False
            lease["spec"] = self._record(transitions + 1, None)
            self.kube.update(self.url, lease)
            log.info("took the lease %s over from %r", self.name, holder or "nobody")
            return self._held()
        except KubeError as err:
            if err.status not in (409, 0) and err.status < 500:
                log.warning("lease %s: %s", self.name, err)
            return False

    def _held(self) -> bool:
        self._last_renewal = self._sending_since
        return True

    def leads(self) -> bool:
        """Whether this replica may still act: its last renewal is recent enough, by its own
        clock (never waits on a call)."""
        return not self._lost and self.clock() - self._last_renewal < self.lease_seconds * STOP_SHARE

    def exit_in(self) -> float:
        """Seconds until this replica must be gone (:data:`EXIT_SHARE` of the lease after the
        last renewal), at least half a second for Kopf's own stop."""
        return max(0.5, self.lease_seconds * EXIT_SHARE - (self.clock() - self._last_renewal))

    def close(self) -> None:
        """A clean stop: every write is refused from now on, though the Lease is still renewed
        (so that no standby leads while the last calls sent are still under way) until released."""
        self._closed = True

    def guard(self, method: str, url: str) -> None:
        """The operator client's write guard: refuses every write once this replica may not act,
        or once it is closed."""
        if self._closed or not self.leads():
            raise NotLeadingError(
                method, url, 0, "NotLeading", f"{self.identity} no longer holds the lease {self.name}"
            )

    def acquire(self, stop: threading.Event, beat: Callable[[], None] = lambda: None) -> bool:
        """Blocks until this replica leads (True) or ``stop`` is set (False); ``beat`` is called
        at every try (a standby's liveness)."""
        logged = False
        while not stop.is_set():
            beat()
            if self.try_acquire_or_renew():
                log.info("leading as %s (lease %s)", self.identity, self.name)
                return True
            if not logged:
                log.info("standing by: another replica holds the lease %s", self.name)
                logged = True
            stop.wait(self.retry_seconds)
        return False

    def keep(self, stop: threading.Event, on_lost: Callable[[], None]) -> None:
        """Renews in one thread and watches in another until ``stop``. ``on_lost`` is called once,
        by the watchdog, when :meth:`leads` turns False or another replica took the Lease over,
        however long a renewal call hangs."""
        lost_once = threading.Event()

        def declare(why: str) -> None:
            if not lost_once.is_set() and not stop.is_set():
                lost_once.set()
                self._lost = True
                log.error("lost the lease %s (%s): stopping", self.name, why)
                on_lost()

        def renew() -> None:
            while not stop.wait(self.renew_seconds) and not lost_once.is_set():
                if not self.try_acquire_or_renew() and self.holder not in ("", self.identity):
                    declare(f"holder now {self.holder!r}")

        def watch() -> None:
            while not stop.wait(WATCH_SECONDS) and not lost_once.is_set():
                if not self.leads():
                    declare(f"not renewed for {self.clock() - self._last_renewal:.1f} s")

        for target, name in ((renew, "lease-renewal"), (watch, "lease-watchdog")):
            threading.Thread(target=target, name=name, daemon=True).start()

    def release(self) -> None:
        """Gives the lease up (a standby takes over at once), if this replica holds it."""
        try:
            lease = self.kube.get_or_none(self.url)
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            lease["spec"]["holderIdentity"] = None
            lease["spec"]["leaseDurationSeconds"] = 1
            lease["spec"]["renewTime"] = times.rfc3339_micro()
            self.kube.update(self.url, lease)
            log.info("released the lease %s", self.name)
        except KubeError as err:
            log.warning("could not release the lease %s: %s", self.name, err)
