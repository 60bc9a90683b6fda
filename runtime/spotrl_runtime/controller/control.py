"""What the controller offers its control surfaces, and what it tells them.

Control surfaces are the things outside the training loop that steer it or watch it: the
SIGTERM handler, the local HTTP endpoint, and in a cluster the Kubernetes bridge that
turns the operator's barrier requests (``status.barrier``) into barrier cuts and reports
steps and cuts back into the RLJob's status. They depend on these two small interfaces
only, so the controller can run with any set of them (none, for a plain local run).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from spotrl_runtime.api import times
from spotrl_runtime.api.rljob import CutRef
from spotrl_runtime.api.times import Deadline
from spotrl_runtime.core.cut_estimate import CutEstimate

if TYPE_CHECKING:
    from spotrl_runtime.checkpoint.resume import SkippedCut


@dataclass(frozen=True)
class CutInfo:
    """A committed cut, as the controller reports it to its control surfaces (the writer's
    :class:`~spotrl_runtime.checkpoint.writer.CommittedCut` without the manifest; in the
    RLJob's status it is a :class:`~spotrl_runtime.api.rljob.CutRef`, :meth:`ref`)."""

    cut_id: str
    step: int
    """Optimizer steps trained when the cut was taken."""
    uri: str
    kind: Literal["periodic", "barrier"]
    committed_at: float
    """Unix time of the manifest's commit."""
    seconds: float
    """From the cut request to the committed manifest."""
    bytes: int = 0
    """Bytes written (files and manifest)."""
    timings: Mapping[str, float] = field(default_factory=dict)
    """The writer's seconds per part (capture, files, manifest ...)."""
    estimate: CutEstimate | None = None
    """A barrier cut's seconds as estimated after this cut (:mod:`spotrl_runtime.core.cut_estimate`)."""
    form: str = "full"
    """``full`` (the trainer's state) or ``delta`` (the redo log since a full cut)."""

    def ref(self) -> CutRef:
        """As ``status.lastCut``."""
        return CutRef(
            id=self.cut_id, step=self.step, uri=self.uri, time=times.rfc3339(self.committed_at), kind=self.kind
        )


class BarrierFailed(RuntimeError):  # noqa: N818 - reads as the event it is: "barrier failed"
    """A barrier cut that did not commit (deadline passed, storage error, run already over)."""


class Controllable(Protocol):
    """The controller, as a control surface drives it. Every method is thread-safe."""

    def request_barrier(self, reason: str, deadline: Deadline) -> CutInfo:
        """Takes a barrier cut that must commit before ``deadline`` and returns it.

        After it returns the controller makes no more ownership moves (generation may
        finish in-flight work, but nothing is admitted or trained): the cut is the last
        word of this controller, and the process waits to be stopped. Raises
        :class:`BarrierFailed` when the cut cannot commit in time.
        """
        ...


class StatusSink(Protocol):
    """Receives what the controller wants the outside world to know. Must not block long."""

    def on_started(self, resumed_from: CutInfo | None, skipped: Sequence[SkippedCut] = ()) -> None:
        """Training starts, from ``resumed_from`` (None: a new run); ``skipped``: newer cuts that
        were passed over as damaged (say so loudly)."""
        ...

    def on_step(self, step: int, metrics: dict[str, Any]) -> None:
        """`step` optimizer steps are trained (the step just committed is ``step - 1``)."""
        ...

    def on_cut(self, cut: CutInfo) -> None: ...

    def on_finished(self, steps: int) -> None:
        """Every step is trained; the process exits 0 next."""
        ...
