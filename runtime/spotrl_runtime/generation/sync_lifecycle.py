"""The weight sync's lifecycle, as two small state machines (pure: no torch, no I/O, no clock of
their own; the caller passes ``now``), one for each end of the channel.

A sync of version ``v`` over an epoch (a set of members, one process group) goes:

``ANNOUNCE``
    Each member first finishes the groups it holds for older versions (it **drains**), then
    announces "drained, ready for ``v``" over the channel's store. The sender's clock has not
    started: a drain may take as long as a generation's tail. A member's own clock starts once
    the pool saw its groups come back: it must announce within the bound from then. A member
    lost meanwhile (its process died, its receive failed) ends the epoch at once.
``FORM``
    Every member announced: the sender says "go" and its clock starts. The epoch's group forms
    (first sync of an epoch only), within the bound.
``SEND``
    The buckets, each collective within the bound.
``DONE`` / ``FAILED`` / ``CANCELLED``
    The end. A failed epoch is aborted (its members told over the store) and its group
    destroyed at both ends; the next sync forms a new epoch of the healthy members. A barrier
    cancels a sync in any phase, at once.

A member waiting for "go" (the others still drain) is bounded by the sender's heartbeat: the
sender refreshes it while it waits for announcements; a member that sees none for the bound
gives up (the sender is gone or stuck).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from enum import StrEnum


class Phase(StrEnum):
    ANNOUNCE = "announce"
    FORM = "form"
    SEND = "send"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def ended(self) -> bool:
        return self in (Phase.DONE, Phase.FAILED, Phase.CANCELLED)


class LifecycleError(RuntimeError):
    """A transition the lifecycle does not have (a bug in its driver, never a member's fault)."""


@dataclass
class SenderSync:
    """One version's sync over one epoch, as the sender's side sees it. ``members``: each
    member's id and the channel ranks it joins as (a worker with tensor parallelism has one per
    engine rank); ``formed``: the epoch's group exists (a later sync of the same epoch)."""

    epoch: int
    version: int
    members: Mapping[str, tuple[int, ...]]
    timeout: float
    formed: bool = False
    phase: Phase = Phase.ANNOUNCE
    reason: str = ""
    culprits: tuple[str, ...] = ()
    """The members that ended the epoch (lost or too slow): they are replaced."""
    clock: float | None = None
    """When the sender's clock started (every member announced)."""
    _drained_at: dict[str, float] = field(default_factory=dict)

    def observe(
        self,
        now: float,
        *,
        announced: Collection[int],
        draining: Collection[str] = (),
        lost: Mapping[str, str] | None = None,
        cancelled: bool = False,
    ) -> Phase:
        """One look while members announce: the ranks that announced, the members still
        draining (their clock has not started), the members lost (id → why), a barrier."""
        self._expect(Phase.ANNOUNCE)
        if cancelled:
            return self.cancel()
        if lost:
            gone = tuple(m for m in self.members if m in lost)
            why = "; ".join(f"{m}: {lost[m]}" for m in gone)
            return self._fail(f"lost before it announced it was ready for version {self.version} ({why})", gone)
        late = []
        for member, ranks in self.members.items():
            if set(ranks) <= set(announced) or member in draining:
                continue
            since = self._drained_at.setdefault(member, now)
            if now - since > self.timeout:
                late.append(member)
        if late:
            return self._fail(
                f"did not announce it was ready for version {self.version} within {self.timeout:g} s of finishing "
                f"its groups: {', '.join(late)}",
                tuple(late),
            )
        if all(set(ranks) <= set(announced) for ranks in self.members.values()):
            self.clock = now
            self.phase = Phase.SEND if self.formed else Phase.FORM
        return self.phase

    def formed_now(self) -> Phase:
        self._expect(Phase.FORM)
        self.formed = True
        self.phase = Phase.SEND
        return self.phase

    def sent(self) -> Phase:
        self._expect(Phase.SEND)
        self.phase = Phase.DONE
        return self.phase

    def failed(self, reason: str, culprits: tuple[str, ...] = ()) -> Phase:
        """The formation or a collective failed or ran past the bound (a member lost mid-send)."""
        if self.phase.ended:
            return self.phase
        return self._fail(reason, culprits)

    def cancel(self) -> Phase:
        if not self.phase.ended:
            self.phase, self.reason = Phase.CANCELLED, f"the sync of weight version {self.version} was cancelled"
        return self.phase

    def deadline(self) -> float | None:
        """When the phase in progress must be over: None while members announce (each member's
        own clock bounds it) and once ended."""
        if self.clock is None or self.phase.ended:
            return None
        return self.clock + self.timeout

    def _fail(self, reason: str, culprits: tuple[str, ...]) -> Phase:
        self.phase, self.reason, self.culprits = Phase.FAILED, reason, culprits
        return self.phase

    def _expect(self, phase: Phase) -> None:
        if self.phase is not phase:
            raise LifecycleError(
                f"weight sync of version {self.version}: in phase {self.phase.value}, not {phase.value}"
            )


@dataclass
class MemberSync:
    """One version's sync at one member (one channel rank): it announced at ``started`` and now
    waits for the sender's "go", then forms (if its group of the epoch is not formed) and
    receives. ``observe`` is asked while it waits for "go"."""

    epoch: int
    version: int
    timeout: float
    started: float
    formed: bool = False
    phase: Phase = Phase.ANNOUNCE
    reason: str = ""
    _beat: object = None
    _beat_at: float = 0.0

    def __post_init__(self) -> None:
        self._beat_at = self.started

    def observe(self, now: float, *, go: bool, aborted: bool, beat: object = None) -> Phase:
        """``go``: the sender's clock started; ``aborted``: the sender ended the epoch (or its
        store is gone); ``beat``: the sender's heartbeat value (it changes while it waits)."""
        if self.phase is not Phase.ANNOUNCE:
            raise LifecycleError(f"member of epoch {self.epoch}: in phase {self.phase.value}, not announce")
        if aborted:
            self.phase, self.reason = Phase.CANCELLED, f"the sender ended the sync of weight version {self.version}"
        elif go:
            self.phase = Phase.SEND if self.formed else Phase.FORM
        else:
            if beat is not None and beat != self._beat:
                self._beat, self._beat_at = beat, now
            if now - self._beat_at > self.timeout:
                self.phase = Phase.FAILED
                self.reason = (
                    f"the sender did not start the sync of weight version {self.version} and sent no sign of "
                    f"waiting for {self.timeout:g} s"
                )
        return self.phase
