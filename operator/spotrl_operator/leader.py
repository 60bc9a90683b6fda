"""One active operator among replicas: a coordination.k8s.io Lease.

Why not Kopf's peering: peers of equal priority pause each other (or both run), and the
replicas of one Deployment all get the same flags. A Lease is exclusive: one holder at a
time, standbys take over when it stops renewing (or at once when it releases on exit).

Expiry is judged the way client-go does it: a standby notes when it last saw the lease
*change* (by its own monotonic clock) and takes over when nothing changed for the
lease's duration, so the replicas' wall clocks need not agree.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from spotrl_runtime.api import times
from spotrl_runtime.kube import Kube, KubeError, path

log = logging.getLogger("spotrl.operator.leader")
Obj = dict[str, Any]


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
        self.url = path("coordination.k8s.io/v1", "leases", namespace, name)
        self.collection = path("coordination.k8s.io/v1", "leases", namespace)
        self.name = name
        self.identity = identity
        self.lease_seconds = lease_seconds
        self.retry_seconds = max(0.5, lease_seconds / 5)
        self.renew_seconds = max(1.0, lease_seconds / 3)
        self.clock = clock
        self._seen: tuple[Any, ...] | None = None
        self._seen_at = 0.0
        self._last_renewal = 0.0
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
        self._last_renewal = self.clock()
        return True

    def acquire(self, stop: threading.Event) -> bool:
        """Blocks until this replica leads (True) or ``stop`` is set (False)."""
        logged = False
        while not stop.is_set():
            if self.try_acquire_or_renew():
                log.info("leading as %s (lease %s)", self.identity, self.name)
                return True
            if not logged:
                log.info("standing by: another replica holds the lease %s", self.name)
                logged = True
            stop.wait(self.retry_seconds)
        return False

    def keep(self, stop: threading.Event, on_lost: Callable[[], None]) -> threading.Thread:
        """Renews in a thread until ``stop``; calls ``on_lost`` (once) when renewals failed for
        2/3 of the lease, early enough that no standby has taken over yet."""

        def loop() -> None:
            while not stop.wait(self.renew_seconds):
                if self.try_acquire_or_renew():
                    continue
                taken = self.holder not in ("", self.identity)
                if taken or self.clock() - self._last_renewal > self.lease_seconds * 2 / 3:
                    log.error("lost the lease %s (holder now %r): stopping", self.name, self.holder)
                    on_lost()
                    return

        thread = threading.Thread(target=loop, name="lease-renewal", daemon=True)
        thread.start()
        return thread

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
