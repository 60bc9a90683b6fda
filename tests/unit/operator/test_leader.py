"""The leader Lease: a leader stops acting by its own clock, whatever its API calls do, and
before any standby may take over."""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

import pytest

from spotrl_operator.leader import EXIT_SHARE, STOP_SHARE, LeaderElector
from spotrl_runtime.kube import KubeError, NotLeadingError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class LeaseStore:
    """One Lease in memory, shared by the replicas' fake clients; ``hang`` blocks every call
    of the client it is set on, as a stalled connection would."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0


class FakeKube:
    def __init__(self, store: LeaseStore, clock: Clock | None = None, call_seconds: float = 0.0):
        self.store = store
        self.hang = threading.Event()
        self.released = threading.Event()
        self.clock = clock
        self.call_seconds = call_seconds

    def _call(self) -> None:
        if self.clock is not None:
            self.clock.now += self.call_seconds  # the call takes this long
        if self.hang.is_set():
            self.released.wait(10)
            raise KubeError("GET", "lease", 0, "Unreachable", "timed out")

    def get_or_none(self, url: str) -> Any:
        self._call()
        return copy.deepcopy(self.store.lease)

    def create(self, url: str, body: Any) -> Any:
        self._call()
        if self.store.lease is not None:
            raise KubeError("POST", url, 409, "AlreadyExists", "")
        self.store.version += 1
        self.store.lease = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.store.version)}}
        return self.store.lease

    def update(self, url: str, body: Any) -> Any:
        self._call()
        assert self.store.lease is not None
        if body["metadata"]["resourceVersion"] != self.store.lease["metadata"]["resourceVersion"]:
            raise KubeError("PUT", url, 409, "Conflict", "")
        self.store.version += 1
        self.store.lease = copy.deepcopy(body)
        self.store.lease["metadata"]["resourceVersion"] = str(self.store.version)
        return self.store.lease


def elector(kube: FakeKube, clock: Clock, identity: str) -> LeaderElector:
    return LeaderElector(kube, "ns", "spotrl-operator", identity, lease_seconds=15.0, clock=clock)  # type: ignore[arg-type]


def test_a_leader_stops_acting_by_its_clock_while_its_renewal_hangs() -> None:
    store, clock = LeaseStore(), Clock()
    kube = FakeKube(store)
    a = elector(kube, clock, "a")
    assert a.try_acquire_or_renew()
    assert a.leads()
    a.guard("PATCH", "/x")  # leading: no refusal
    kube.hang.set()
    renewal = threading.Thread(target=a.try_acquire_or_renew, daemon=True)
    renewal.start()  # blocked in its GET
    clock.now += 15.0 * STOP_SHARE
    assert not a.leads()
    with pytest.raises(NotLeadingError) as refused:
        a.guard("PATCH", "/apis/policy/v1/namespaces/ns/poddisruptionbudgets/j")
    assert refused.value.status == 0
    assert refused.value.reason == "NotLeading"
    kube.released.set()
    renewal.join(5)


def test_the_watchdog_declares_the_loss_without_waiting_for_the_hung_call() -> None:
    store, clock = LeaseStore(), Clock()
    kube = FakeKube(store)
    a = elector(kube, clock, "a")
    assert a.try_acquire_or_renew()
    a.renew_seconds = 0.05
    kube.hang.set()  # every renewal from now on hangs
    lost = threading.Event()
    stop = threading.Event()
    a.keep(stop, lost.set)
    time.sleep(0.3)  # the renewal thread is now stuck in its call
    assert not lost.is_set()
    clock.now += 15.0 * STOP_SHARE + 0.01
    assert lost.wait(2), "the watchdog did not declare the loss while the renewal hung"
    assert a.exit_in() == pytest.approx(15.0 * (EXIT_SHARE - STOP_SHARE) - 0.01, abs=0.02)
    stop.set()
    kube.released.set()


def test_a_renewal_counts_from_when_it_was_sent_not_answered() -> None:
    store, clock = LeaseStore(), Clock()
    a = elector(FakeKube(store, clock, call_seconds=4.0), clock, "a")  # each call takes 4 s
    sent = clock.now
    assert a.try_acquire_or_renew()  # GET + POST: answered 8 s after it was sent
    clock.now = sent + 15.0 * STOP_SHARE
    assert not a.leads()


def test_a_standby_takes_over_only_after_the_leader_must_be_gone() -> None:
    """The standby waits the whole lease from the last change it saw; the leader stopped
    acting at STOP_SHARE and exited by EXIT_SHARE of it."""
    store, clock = LeaseStore(), Clock()
    a, b = elector(FakeKube(store), clock, "a"), elector(FakeKube(store), clock, "b")
    assert a.try_acquire_or_renew()
    renewed = clock.now
    assert not b.try_acquire_or_renew()  # b sees the lease change now
    clock.now = renewed + 15.0 * EXIT_SHARE
    assert not a.leads()
    assert a.exit_in() == 0.5
    assert not b.try_acquire_or_renew()
    clock.now = renewed + 15.0 + 0.01
    assert b.try_acquire_or_renew()
    assert b.leads()
    assert store.lease is not None
    assert store.lease["spec"]["holderIdentity"] == "b"
    assert not a.try_acquire_or_renew()
    assert a.holder == "b"


def test_a_leader_that_sees_another_holder_declares_the_loss_at_once() -> None:
    store, clock = LeaseStore(), Clock()
    a, b = elector(FakeKube(store), clock, "a"), elector(FakeKube(store), clock, "b")
    assert a.try_acquire_or_renew()
    assert store.lease is not None
    store.lease["spec"]["holderIdentity"] = "b"  # taken over (a clock that ran slow)
    a.renew_seconds = 0.05
    lost, stop = threading.Event(), threading.Event()
    a.keep(stop, lost.set)
    assert lost.wait(2)
    stop.set()
    assert not a.leads(), "a leader that saw another holder still allowed writes"
    with pytest.raises(NotLeadingError):
        a.guard("POST", "/api/v1/namespaces/ns/pods")
    assert not b.leads()  # b never renewed


def test_a_closed_leader_refuses_every_write_yet_keeps_its_lease_until_released() -> None:
    store, clock = LeaseStore(), Clock()
    a = elector(FakeKube(store), clock, "a")
    assert a.try_acquire_or_renew()
    a.guard("PATCH", "/x")
    a.close()
    with pytest.raises(NotLeadingError):
        a.guard("PATCH", "/x")
    assert a.leads(), "not lost: the watchdog must not declare a loss (and exit hard) on a clean stop"
    assert a.try_acquire_or_renew(), "still renewed while the last calls finish"
    a.release()
    assert store.lease is not None
    assert store.lease["spec"]["holderIdentity"] is None


def test_a_clean_stop_closes_the_guard_then_waits_for_the_pools_then_releases() -> None:
    """main._shut_down, after Kopf has stopped: in that order, renewing until the release."""
    from spotrl_operator.main import _shut_down

    said: list[str] = []
    renewing = threading.Event()

    class Elector:
        def close(self) -> None:
            said.append("close")

        def release(self) -> None:
            said.append(f"release (renewing stopped: {renewing.is_set()})")

    class Ctx:
        def drain(self, seconds: float) -> bool:
            said.append(f"drain {seconds:g} s (renewing stopped: {renewing.is_set()})")
            return True

    _shut_down(Elector(), Ctx(), renewing, 15.0)
    assert said == ["close", "drain 15 s (renewing stopped: False)", "release (renewing stopped: True)"]


def test_the_pools_are_waited_for_within_the_bound() -> None:
    """A pass still running in a worker thread after Kopf stopped (a daemon cancelled while its
    call runs): drain waits for it, but no longer than asked."""
    from spotrl_operator.handlers import Context
    from spotrl_operator.metrics import Metrics
    from spotrl_operator.settings import Settings
    from spotrl_runtime.kube import Kube

    ctx = Context(settings=Settings(), kube=Kube(api_client=None), metrics=Metrics())
    done = threading.Event()
    ctx.executor.submit(done.wait, 10)
    ctx.handler_executor.submit(time.sleep, 0.2)
    started = time.monotonic()
    assert not ctx.drain(0.3), "a call still under way"
    assert time.monotonic() - started < 2
    done.set()
    assert ctx.drain(5)
