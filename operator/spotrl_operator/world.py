"""What :func:`~spotrl_operator.reconcile.reconcile` decides on and what it returns, pure.

- :class:`World`: the job, its pods and the nodes under them, as :mod:`~spotrl_operator.observe`
  saw them;
- the actions (create or delete a pod, ask for a barrier, open or close the PDB, an Event)
  and the :class:`Plan` that holds them with the status to write;
- :class:`Builder`: the plan and the new status while the lifecycle
  (:mod:`~spotrl_operator.reconcile`), the worker pods (:mod:`~spotrl_operator.workers`) and
  the trainer pods (:mod:`~spotrl_operator.trainers`) walk their cases.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import ClassVar, Literal

from spotrl_operator.queueing import (
    CreateWorkload,
    DeleteWorkload,
    FinishWorkload,
    LetGoWorkload,
    QueueView,
    ReleaseQuota,
)
from spotrl_operator.signals import Signal
from spotrl_runtime.api import times
from spotrl_runtime.api.rljob import BarrierStatus, Condition, JobPhase, RecoveryMarks, RLJobSpec, RLJobStatus


@dataclass(frozen=True)
class PodView:
    """What the lifecycle needs to know about one controller pod."""

    name: str
    attempt: int
    phase: str
    """Pending, Running, Succeeded, Failed or Unknown."""
    node: str | None = None
    deleting_since: datetime | None = None
    exit_code: int | None = None
    exit_message: str | None = None
    """The last line of the container's termination message (its error, as the CLI prints it)."""
    disruption: str | None = None
    """Reason of a DisruptionTarget=True condition (EvictionByEvictionAPI, TerminationByKubelet...)."""
    index: int | None = None
    """Worker and trainer pods: the pod's index within the attempt."""
    scheduled_at: datetime | None = None
    """When the pod was bound to a node (its PodScheduled condition turned True)."""
    standby: bool = False
    """A controller pod that still carries the standby label (``spec.standby``)."""
    rejected: str | None = None
    """Failed by the kubelet before any container ran (its admission refused it): why."""


@dataclass(frozen=True)
class World:
    """Everything :func:`reconcile` looks at, observed at `now` (timezone-aware UTC)."""

    now: datetime
    generation: int
    spec: RLJobSpec
    status: RLJobStatus
    job: str = ""
    """The RLJob's name (its pods' names derive from it)."""
    pods: tuple[PodView, ...] = ()
    """The job's controller pods (its standby not among them)."""
    standbys: tuple[PodView, ...] = ()
    """Controller pods made ahead of their attempt (``spec.standby``), waiting for it."""
    workers: tuple[PodView, ...] = ()
    """The job's generation worker pods (``spec.generation.workerPods``), of every attempt."""
    trainers: tuple[PodView, ...] = ()
    """The job's trainer pods (``spec.training.parallelism.trainerPods``), of every attempt."""
    signals: tuple[Signal, ...] = ()
    """Signals on the nodes of the job's controller and trainer pods, and DisruptionTarget on
    its controller pods (a trainer pod's is its :attr:`PodView.disruption`)."""
    unusable_nodes: frozenset[str] = frozenset()
    """Nodes about to go or gone: with a notice, cordoned, NotReady or deleted."""
    avoid_nodes: frozenset[str] = frozenset()
    """The unusable nodes a new pod of this job must name to be kept off them (the others the
    scheduler avoids by itself, or the job's placement never chooses)."""
    lost_nodes: frozenset[str] = frozenset()
    """Nodes whose kubelet will confirm nothing any more: out of service, Ready Unknown for a
    grace period, or deleted (:mod:`~spotrl_operator.fleet`)."""
    missing_children: tuple[str, ...] = ()
    """Kinds of the job's own objects (ServiceAccount, Role, RoleBinding, Service, PDB,
    NetworkPolicy) that do not exist, or exist but belong to another RLJob uid."""
    force_deletes_paused: str | None = None
    """Why the job's pods on unhealthy nodes are not force-deleted (too many nodes unhealthy at once)."""
    pdb_open: bool = False
    pdb_stale: bool = False
    """The PDB is closed, but not as the job wants it (it holds another number of pods, or
    other ones): closing it again sets it right."""
    deadline_caps: Mapping[str, int] = field(default_factory=dict)
    """Barrier deadline caps in seconds by notice provider (:attr:`Signal.provider`)."""
    clouds: frozenset[str] | None = None
    """The clouds the cluster's nodes run on (:func:`~spotrl_operator.signals.node_cloud`):
    a cloud's own notice provider (GKE's, AKS's) can reach the job only where its cloud is
    among them. None: not known, so any may."""
    skipped_fields: tuple[str, ...] = ()
    """Dotted paths of the stored job (``spec.…``, ``status.…``) that this version does not know and
    skipped: a newer CRD, operator or controller wrote them (the ``VersionSkew`` condition)."""
    config_error: str | None = None
    """Why the job cannot run at all as configured (e.g. no storage anywhere); it fails."""
    storage_conflict: str | None = None
    """Why no controller may start: an older RLJob's storage overlaps this one's
    (:func:`~spotrl_operator.storage_overlap.conflict`)."""
    queue: QueueView | None = None
    """Kueue: the job's LocalQueue and Workload, when it carries the queue-name label
    (:mod:`~spotrl_operator.queueing`)."""


@dataclass(frozen=True)
class CreateControllerPod:
    attempt: int
    avoid_nodes: frozenset[str]
    standby: bool = False
    """Made ahead of its attempt, to wait warm for it (:mod:`~spotrl_operator.standby`)."""


@dataclass(frozen=True)
class CreateNodePod:
    """A pod that joins the controller's Ray head as a node of its own (:attr:`role`)."""

    attempt: int
    index: int
    address: str
    """The Ray head the pod joins (``status.rayHead.address``)."""
    avoid_nodes: frozenset[str]
    role: ClassVar[Literal["worker", "trainer"]]


class CreateWorkerPod(CreateNodePod):
    """Generation worker ``index`` (``generation.workerPods``)."""

    role = "worker"


class CreateTrainerPod(CreateNodePod):
    """Trainer pod ``index``, one per rank (``training.parallelism.trainerPods``)."""

    role = "trainer"


@dataclass(frozen=True)
class DeletePod:
    name: str
    force: bool = False
    """Grace period 0: only for a pod whose node stopped answering."""


@dataclass(frozen=True)
class PromoteStandby:
    """Takes the standby label off the pod that is now the job's controller, so that the
    PodDisruptionBudget holds it (its attempt is on the status already)."""

    name: str


@dataclass(frozen=True)
class RequestBarrier:
    barrier: BarrierStatus
    provider: str
    """Who sent the notice (:attr:`~spotrl_operator.signals.Signal.provider`, or ``suspend``)."""


@dataclass(frozen=True)
class OpenDisruptionBudget:
    pass


@dataclass(frozen=True)
class CloseDisruptionBudget:
    pass


@dataclass(frozen=True)
class EnsureChildren:
    """Make again the job's objects that are missing (deleted by hand, or never made)."""

    kinds: tuple[str, ...]


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


Action = (
    CreateControllerPod
    | CreateWorkerPod
    | CreateTrainerPod
    | DeletePod
    | PromoteStandby
    | RequestBarrier
    | OpenDisruptionBudget
    | CloseDisruptionBudget
    | EnsureChildren
    | Event
    | CreateWorkload
    | DeleteWorkload
    | ReleaseQuota
    | FinishWorkload
    | LetGoWorkload
)


@dataclass
class Plan:
    """What to do now, the status to write, and when to look again (seconds)."""

    actions: list[Action] = field(default_factory=list)
    status: RLJobStatus | None = None
    requeue_after: float | None = None

    def requeue_within(self, seconds: float) -> None:
        """Look again after at most ``seconds`` (an earlier wish stands)."""
        self.requeue_after = seconds if self.requeue_after is None else min(self.requeue_after, seconds)


def set_condition(
    status: RLJobStatus, now: datetime, generation: int, ctype: str, value: bool, reason: str, message: str
) -> RLJobStatus:
    """Sets one condition; lastTransitionTime moves only when its status value changes."""
    new: Literal["True", "False"] = "True" if value else "False"
    old = next((c for c in status.conditions if c.type == ctype), None)
    cond = Condition(
        type=ctype,
        status=new,
        reason=reason,
        message=message,
        last_transition_time=old.last_transition_time if old and old.status == new else times.rfc3339(now),
        observed_generation=generation,
    )
    others = [c for c in status.conditions if c.type != ctype]
    return status.model_copy(update={"conditions": [*others, cond]})


# ----------------------------------------------------------------------------- the builder


class Builder:
    """Accumulates the plan and the new status while :func:`reconcile` walks the cases."""

    def __init__(self, world: World):
        self.world = world
        self.plan = Plan()
        self.st = world.status.model_copy(
            update={"observed_generation": world.generation, "total_steps": world.spec.training.total_steps}
        )
        self.held: str | None = None
        """Why Kueue holds the job now (:func:`~spotrl_operator.queueing.tend`): it stops as a suspend does."""

    @property
    def stopping(self) -> bool:
        """The job must not run now: suspended, or held by Kueue."""
        return self.world.spec.suspend or self.held is not None

    def act(self, *actions: Action) -> None:
        self.plan.actions.extend(actions)

    def event(self, type_: Literal["Normal", "Warning"], reason: str, message: str) -> None:
        self.plan.actions.append(Event(type_, reason, message))

    def update(self, **fields: object) -> None:
        self.st = self.st.model_copy(update=fields)

    def condition(self, ctype: str, value: bool, reason: str, message: str) -> None:
        self.st = set_condition(self.st, self.world.now, self.world.generation, ctype, value, reason, message)

    def has_condition(self, ctype: str, status: str = "True") -> bool:
        return any(c.type == ctype and c.status == status for c in self.st.conditions)

    def phase(self, phase: JobPhase, message: str) -> None:
        """Sets the phase (an Event when it changes) and keeps the conditions in step with it."""
        if self.st.phase != phase:
            self.event("Warning" if phase == "Failed" else "Normal", phase, message)
        self.update(phase=phase, message=message)
        if phase != "Running" and self.has_condition("Running"):
            self.condition("Running", False, phase, message)
        if phase == "Suspended":
            self.condition("Suspended", True, "Suspended", message)
        elif self.has_condition("Suspended"):
            self.condition("Suspended", False, "Resumed", "spec.suspend is false")

    def serving_attempt(self, through_suspend: bool = False) -> int | None:
        """The attempt whose Ray node pods (workers, trainers) are wanted: that of the newest
        controller, running, not being stopped by this plan, not on a lost node, that published
        its Ray head. None: none is wanted. ``through_suspend``: still wanted while the job
        suspends (the suspend's barrier cut needs them) until the controller is stopped;
        otherwise none is wanted once the job is suspended or done."""
        world, head = self.world, self.st.ray_head
        live = sorted((p for p in world.pods if p.deleting_since is None), key=lambda p: p.attempt)
        current = live[-1] if live else None
        if current is None or head is None or head.attempt != current.attempt:
            return None
        stopping = {a.name for a in self.plan.actions if isinstance(a, DeletePod)}
        if current.phase != "Running" or current.name in stopping or current.node in world.lost_nodes:
            return None
        if not through_suspend and (self.stopping or self.st.phase in ("Succeeded", "Failed", "Suspended", "Queued")):
            return None
        return current.attempt

    def interrupted(self) -> None:
        """The running controller's work stops (once per interruption). What is lost starts at
        the newest safe progress: the newest committed cut (a barrier cut: just now; after an
        abrupt loss, the periodic cut whose later steps are trained again), or when this
        controller began training if it has cut nothing since."""
        if self.st.interrupted_at is not None:
            return
        cut = times.parse(self.st.last_cut.time) if self.st.last_cut else None
        safe = [t for t in (cut, times.parse(self.st.training_since)) if t is not None]
        since = min(self.world.now, max(safe)) if safe else self.world.now
        self.update(interrupted_at=times.rfc3339(since), interrupted_attempt=self.st.attempt)
        marks = self.st.recovering
        if marks is None or marks.attempt != self.st.attempt:
            marks = RecoveryMarks(attempt=self.st.attempt)  # an abrupt loss: no notice came first
        if marks.interrupted_at is None:
            self.update(recovering=marks.model_copy(update={"interrupted_at": times.rfc3339_micro(self.world.now)}))

    def finish(self) -> Plan:
        """The plan, with the status as the walk left it. The end: nothing changes it after."""
        self.plan.status = self.st
        return self.plan
