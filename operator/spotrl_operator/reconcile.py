"""The RLJob lifecycle as a pure function: what the world looks like → what to do next.

The operator is level-triggered: on every event and on a short timer it observes the job,
its controller pods and the nodes under them (:class:`World`), calls :func:`reconcile`,
and applies the returned :class:`Plan`. Everything the decision needs to survive an
operator restart is on the RLJob's status, never in memory, so a new operator replica
reaches the same plan from the same world and neither loses nor repeats a barrier.

The barrier, step by step (a node hosting the controller gets a notice):

1. :class:`RequestBarrier` writes ``status.barrier`` (state ``Requested``, an id, the
   controller ``attempt`` it is for, a deadline). The PodDisruptionBudget stays closed, so
   a drain waits at 429.
2. The controller, watching its RLJob, takes a barrier cut and patches
   ``status.barrier.state = Committed`` for that id (or ``Failed`` with a message); from
   then on it makes no ownership moves.
3. :class:`OpenDisruptionBudget` and :class:`DeletePod`: the drain may proceed, and the
   controller (SIGTERM; nothing left to write) leaves the node.
4. When the pod is gone: :class:`CreateControllerPod` with the next attempt number on a
   node without a notice, resuming from the newest committed cut (the barrier cut); and
   :class:`CloseDisruptionBudget`.

If the deadline passes first, the barrier is ``Missed`` (a condition and an Event) and the
job falls back to its newest committed cut, usually the last periodic one. A node that
stopped answering gets no barrier at all: nobody is left to cut.

Attempts: ``status.attempt`` is written before the pod of that attempt is created, and
``status.controllerPod`` only once the pod has been seen. An attempt whose pod was never
seen (the operator stopped in between, or its cache lags) is created again under the same
deterministic name instead of counting a new attempt, so a restart neither loses nor
repeats a controller.

Worker pods (``spec.generation.workerPods``): a controller that wants its generation
workers in pods of their own publishes its Ray head in ``status.rayHead`` (address,
attempt, how many workers). While that controller runs, :func:`_tend_workers` keeps one
pod per worker index of its attempt: it creates a missing one (:class:`CreateWorkerPod`,
deterministic name, so a second create is a no-op), deletes one that ended so that it is
created again after a backoff (``failureBudget``'s doubling wait, see
:func:`worker_backoff`; ``status.workerRestarts`` counts them for the attempt, so a worker
that crashes at once is not recreated in a hot loop), and force-deletes one whose node
stopped answering, at once and without a backoff (a worker holds nothing to save, and its
node is no fault of it).
Losing a worker is **not** a preemption of the job: no barrier, no new controller, nothing
counted against the failure budget's crashes; the controller sends the lost worker's
groups to the other workers. Workers of any other attempt, and every worker once
the controller stops, suspends, finishes or fails, are deleted.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Literal

from spotrl_operator.signals import Signal
from spotrl_runtime.api.rljob import BarrierStatus, Condition, FailureBudget, JobPhase, RLJobSpec, RLJobStatus

# A pod stuck in Terminating on a node whose kubelet stopped answering is never confirmed
# gone; after this long we force-delete it so a fresh controller can start.
LOST_NODE_TERMINATING_GRACE = timedelta(seconds=5)


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
    disruption: str | None = None
    """Reason of a DisruptionTarget=True condition (EvictionByEvictionAPI, TerminationByKubelet...)."""
    index: int | None = None
    """Worker pods: the worker index within the attempt."""


@dataclass(frozen=True)
class World:
    """Everything :func:`reconcile` looks at, observed at `now` (timezone-aware UTC)."""

    now: datetime
    generation: int
    spec: RLJobSpec
    status: RLJobStatus
    pods: tuple[PodView, ...] = ()
    """The job's controller pods."""
    workers: tuple[PodView, ...] = ()
    """The job's generation worker pods (``spec.generation.workerPods``), of every attempt."""
    signals: tuple[Signal, ...] = ()
    """Signals on the nodes of this job's pods, and DisruptionTarget on its pods."""
    unusable_nodes: frozenset[str] = frozenset()
    """Nodes about to go or gone: with a notice, cordoned, NotReady or deleted."""
    avoid_nodes: frozenset[str] = frozenset()
    """The unusable nodes a new pod of this job must name to be kept off them (the others the
    scheduler avoids by itself, or the job's placement never chooses)."""
    lost_nodes: frozenset[str] = frozenset()
    """Nodes whose kubelet confirms nothing any more: Ready Unknown, or deleted."""
    pdb_open: bool = False
    deadline_caps: Mapping[str, int] = field(default_factory=dict)
    """Barrier deadline caps in seconds by notice provider (:attr:`Signal.provider`)."""
    config_error: str | None = None
    """Why the job cannot run at all as configured (e.g. no storage anywhere); it fails."""


# ----------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class CreateControllerPod:
    attempt: int
    avoid_nodes: frozenset[str]


@dataclass(frozen=True)
class CreateWorkerPod:
    attempt: int
    index: int
    address: str
    """The Ray head the worker joins (``status.rayHead.address``)."""
    avoid_nodes: frozenset[str]


@dataclass(frozen=True)
class DeletePod:
    name: str
    force: bool = False
    """Grace period 0: only for a pod whose node stopped answering."""


@dataclass(frozen=True)
class RequestBarrier:
    barrier: BarrierStatus


@dataclass(frozen=True)
class OpenDisruptionBudget:
    pass


@dataclass(frozen=True)
class CloseDisruptionBudget:
    pass


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


Action = (
    CreateControllerPod
    | CreateWorkerPod
    | DeletePod
    | RequestBarrier
    | OpenDisruptionBudget
    | CloseDisruptionBudget
    | Event
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


# ----------------------------------------------------------------------------- helpers


def iso(t: datetime) -> str:
    """RFC 3339 in UTC, second precision, as Kubernetes writes times."""
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(t: str | None) -> datetime | None:
    """RFC 3339 (any precision, ``Z`` or an offset); a time without a zone is UTC."""
    if not t:
        return None
    parsed = datetime.fromisoformat(t)
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)


def barrier_id(reason: str, pod: str) -> str:
    """Deterministic, so two operator replicas (or a restarted one) ask for the same barrier."""
    return hashlib.sha256(f"{pod}|{reason}".encode()).hexdigest()[:12]


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
        last_transition_time=old.last_transition_time if old and old.status == new else iso(now),
        observed_generation=generation,
    )
    others = [c for c in status.conditions if c.type != ctype]
    return status.model_copy(update={"conditions": [*others, cond]})


def crash_backoff(budget: FailureBudget, restarts: int) -> float:
    """Seconds before retry number `restarts` (1-based): doubling, capped."""
    return float(min(budget.max_backoff_seconds, budget.backoff_seconds * 2 ** max(0, restarts - 1)))


def worker_backoff(spec: RLJobSpec, last: int | None, last_ended: datetime | None, now: datetime) -> int:
    """Seconds before a worker pod that ended is replaced: the last backoff doubled, capped; or
    the first backoff again once the workers ran for twice the cap since the last one ended (as
    the kubelet forgets a container's crash loop), so a worker that fails once a day on a run
    of weeks is not held at the cap for ever."""
    budget = spec.failure_budget
    calm = last_ended is None or (now - last_ended).total_seconds() >= 2 * budget.max_backoff_seconds
    if last is None or calm:
        return min(budget.max_backoff_seconds, budget.backoff_seconds)
    return min(budget.max_backoff_seconds, max(last * 2, budget.backoff_seconds))


# ----------------------------------------------------------------------------- reconcile


class _Builder:
    """Accumulates the plan and the new status while :func:`reconcile` walks the cases."""

    def __init__(self, world: World):
        self.world = world
        self.plan = Plan()
        self.st = world.status.model_copy(
            update={"observed_generation": world.generation, "total_steps": world.spec.training.total_steps}
        )

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

    def interrupted(self) -> None:
        """The running controller's work stops (once per interruption). What is lost starts at
        the newest safe progress: the newest committed cut (a barrier cut: just now; after an
        abrupt loss, the periodic cut whose later steps are trained again), or when this
        controller began training if it has cut nothing since."""
        if self.st.interrupted_at is not None:
            return
        cut = parse_time(self.st.last_cut.time) if self.st.last_cut else None
        safe = [t for t in (cut, parse_time(self.st.training_since)) if t is not None]
        since = min(self.world.now, max(safe)) if safe else self.world.now
        self.update(interrupted_at=iso(since), interrupted_attempt=self.st.attempt)

    def done(self, requeue_after: float | None = None) -> Plan:
        self.plan.status = self.st
        self.plan.requeue_after = requeue_after
        return self.plan


def reconcile(world: World) -> Plan:
    """The next step of the job's lifecycle. Pure: the same world gives the same plan."""
    b = _Builder(world)
    plan = _lifecycle(b)
    _tend_workers(b, plan)
    plan.status = b.st
    return plan


def _lifecycle(b: _Builder) -> Plan:
    """The controller's lifecycle (the worker pods follow it in :func:`_tend_workers`)."""
    world = b.world
    if b.st.phase in ("Succeeded", "Failed"):
        return b.done()

    live = sorted((p for p in world.pods if p.deleting_since is None), key=lambda p: p.attempt)
    for stale in live[:-1]:  # never two controllers
        b.act(DeletePod(stale.name))
    for p in world.pods:
        stuck = p.deleting_since is not None and world.now - p.deleting_since >= LOST_NODE_TERMINATING_GRACE
        if stuck and p.node in world.lost_nodes:
            b.act(DeletePod(p.name, force=True))
    current = live[-1] if live else None
    if current is not None:
        b.update(controller_pod=current.name, controller_node=current.node)
    _account_time_lost(b)

    if world.config_error:
        for p in live:
            b.act(DeletePod(p.name))
        b.condition("Failed", True, "InvalidConfiguration", world.config_error)
        b.phase("Failed", world.config_error)
        return b.done()

    if current is not None and current.phase in ("Succeeded", "Failed"):
        return _finished(b, current)
    if world.spec.suspend:
        return _suspend(b, current)
    if current is None:
        return _start(b)
    return _running(b, current)


def _account_time_lost(b: _Builder) -> None:
    """A fresh controller has trained its first step: the interruption is over."""
    st = b.st
    interrupted = parse_time(st.interrupted_at)
    # The interrupted controller may still report steps (a missed barrier) until it is gone:
    # only a later attempt's step ends the interruption.
    later = st.step_attempt is not None and st.step_attempt == st.attempt > (st.interrupted_attempt or 0)
    if interrupted is not None and later:
        lost = (b.world.now - interrupted).total_seconds()
        b.update(
            seconds_lost=round(st.seconds_lost + max(0.0, lost), 3),
            interrupted_at=None,
            interrupted_attempt=None,
            training_since=iso(b.world.now),
        )
        b.event("Normal", "Resumed", f"training again after {lost:.0f} s; {st.preemptions} preemption(s) survived")


def _finished(b: _Builder, pod: PodView) -> Plan:
    world, spec = b.world, b.world.spec
    if pod.phase == "Succeeded" and (b.st.step or 0) >= spec.training.total_steps:
        b.condition("Complete", True, "Trained", f"trained {spec.training.total_steps} steps")
        b.phase("Succeeded", f"trained {spec.training.total_steps} steps")
        return b.done()
    b.act(DeletePod(pod.name))
    if _is_preemption(pod, world):
        b.interrupted()
        b.phase("Rescheduling", f"controller {pod.name} was stopped on node {pod.node} ({pod.disruption or 'node'})")
        return b.done(1.0)
    restarts = b.st.restarts + 1
    why = (
        f"exit code {pod.exit_code}"
        if pod.phase == "Failed"
        else f"exited 0 after {b.st.step or 0} of {spec.training.total_steps} steps"
    )
    b.update(restarts=restarts)
    if restarts > spec.failure_budget.max_crashes:
        budget = spec.failure_budget.max_crashes
        msg = f"controller crashed {restarts} times (last: {why}); failureBudget.maxCrashes is {budget}"
        b.condition("Failed", True, "FailureBudgetExhausted", msg)
        b.phase("Failed", msg)
        return b.done()
    wait = crash_backoff(spec.failure_budget, restarts)
    b.update(retry_after=iso(world.now + timedelta(seconds=wait)))
    b.event(
        "Warning",
        "ControllerCrashed",
        f"{pod.name} crashed ({why}); retry {restarts} of {spec.failure_budget.max_crashes} in {wait:.0f} s",
    )
    b.phase("Rescheduling", f"controller crashed ({why}); retrying in {wait:.0f} s")
    return b.done(1.0)


def _is_preemption(pod: PodView, world: World) -> bool:
    """A pod that ended because its node went away, not because its program failed."""
    if pod.disruption:
        return True
    if pod.node and pod.node in world.unusable_nodes | world.lost_nodes:
        return True
    barrier = world.status.barrier
    return barrier is not None and barrier.state in ("Requested", "Committed", "Missed")


def _suspend(b: _Builder, current: PodView | None) -> Plan:
    world = b.world
    if current is None:
        if any(p.deleting_since is not None for p in world.pods):
            b.phase("Checkpointing", "suspending: waiting for the controller to exit")
            return b.done(1.0)
        b.phase("Suspended", "suspended; set spec.suspend=false to resume from the last cut")
        return b.done()
    # A barrier already asked of this controller (a notice came first) serves the suspend
    # too: asking again would make it cut twice.
    barrier = b.st.barrier
    if barrier is None:
        req = _new_barrier(b, "suspend", current, node=None)
        b.event("Normal", "BarrierRequested", f"suspending: barrier {req.request_id} requested")
        b.phase("Checkpointing", "suspending: waiting for the barrier cut")
        return b.done(1.0)
    if barrier.state == "Requested" and not _past_deadline(b, barrier):
        b.phase("Checkpointing", "suspending: waiting for the barrier cut")
        return b.done(1.0)
    if barrier.state == "Requested":
        _missed(b, barrier)
    elif barrier.state == "Failed":
        _failed(b, barrier)
    elif barrier.state == "Committed":
        _committed(b, barrier, first=b.st.message != _SUSPEND_STOPPING)
    b.act(DeletePod(current.name))
    b.phase("Checkpointing", _SUSPEND_STOPPING)
    return b.done(1.0)


def _start(b: _Builder) -> Plan:
    world, st = b.world, b.st
    blocking = [p for p in world.pods if p.deleting_since is not None and p.node not in world.lost_nodes]
    if blocking:
        # The previous controller may still be writing its SIGTERM cut; a new one must see it.
        b.phase(st.phase or "Pending", f"waiting for {blocking[0].name} to exit")
        return b.done(1.0)
    retry_after = parse_time(st.retry_after)
    if retry_after is not None and world.now < retry_after:
        return b.done((retry_after - world.now).total_seconds())
    if st.attempt > 0 and st.controller_pod is None:
        # Attempt N is on the status but its pod was never seen: the operator stopped between
        # writing the status and creating the pod, or the pod is not in its cache yet. Create
        # it (again: the name is deterministic, a second create is a no-op) without counting
        # anything a second time.
        b.act(CreateControllerPod(st.attempt, world.avoid_nodes))
        return b.done(1.0)

    first = st.attempt == 0
    crash = retry_after is not None
    resumed_from_suspend = st.phase == "Suspended" or (st.barrier is not None and st.barrier.reason == "suspend")
    if not (first or crash or resumed_from_suspend):
        b.interrupted()  # it vanished: evicted, drained, moved by us, or its node was lost
        b.update(preemptions=st.preemptions + 1)
    attempt = st.attempt + 1
    b.update(
        attempt=attempt,
        barrier=None,
        retry_after=None,
        controller_pod=None,
        controller_node=None,
        ray_head=None,
        worker_restarts=0,
        worker_retry_after=None,
        worker_backoff_seconds=None,
    )
    b.act(CreateControllerPod(attempt, world.avoid_nodes))
    if world.pdb_open:
        b.act(CloseDisruptionBudget())
    if first:
        b.update(training_since=iso(world.now))
        b.event("Normal", "ControllerCreated", "controller attempt 1")
        b.phase("Pending", "starting the controller")
    else:
        b.event("Normal", "ControllerCreated", f"controller attempt {attempt}, resuming from the newest committed cut")
        b.phase("Rescheduling", f"starting controller attempt {attempt}")
    return b.done(1.0)


def _running(b: _Builder, current: PodView) -> Plan:
    world = b.world
    barrier = b.st.barrier
    if current.node in world.lost_nodes:
        b.event("Warning", "NodeLost", f"node {current.node} stopped answering; no barrier is possible")
        b.act(DeletePod(current.name, force=True))
        b.interrupted()
        b.phase("Rescheduling", f"node {current.node} lost; resuming from the newest committed cut")
        return b.done(1.0)

    if barrier is not None and barrier.state == "Requested":
        if _past_deadline(b, barrier):
            _missed(b, barrier)
            b.act(OpenDisruptionBudget(), DeletePod(current.name))
            b.interrupted()
            b.phase("Rescheduling", "barrier missed its deadline; resuming from the newest committed cut")
            return b.done(1.0)
        b.phase("Checkpointing", f"barrier cut requested ({barrier.reason})")
        return b.done(1.0)
    if barrier is not None:
        # Committed: the cut is safe and the controller makes no more moves. Missed or
        # Failed: the chance is gone. Either way let the drain through and leave the node.
        if barrier.state == "Failed":
            _failed(b, barrier)
        elif barrier.state == "Committed":
            _committed(b, barrier, first=b.st.phase != "Rescheduling")
        if not world.pdb_open:
            b.act(OpenDisruptionBudget())
        b.act(DeletePod(current.name))
        b.interrupted()
        b.phase("Rescheduling", f"moving the controller off node {barrier.node} (barrier {barrier.state.lower()})")
        return b.done(1.0)

    notices = [s for s in world.signals if s.node == current.node]
    if notices:
        sig = notices[0]
        req = _new_barrier(b, sig.reason, current, node=current.node, provider=sig.provider)
        b.event(
            "Warning",
            "PreemptionNotice",
            f"{sig.reason} on node {current.node}: barrier {req.request_id} requested, deadline {req.deadline}",
        )
        b.phase("Checkpointing", f"barrier cut requested ({sig.reason})")
        return b.done(1.0)

    if world.pdb_open:
        b.act(CloseDisruptionBudget())
    if current.phase == "Running":
        b.condition("Running", True, "ControllerRunning", f"{current.name} on node {current.node}")
        b.phase("Running", f"controller {current.name} on node {current.node}")
        return b.done()
    b.phase(b.st.phase or "Pending", f"controller {current.name} is {current.phase}")
    return b.done(2.0)


def _new_barrier(
    b: _Builder, reason: str, pod: PodView, node: str | None, provider: str | None = None
) -> BarrierStatus:
    now = b.world.now
    seconds = b.world.spec.checkpoint.barrier_deadline_seconds
    cap = b.world.deadline_caps.get(provider) if provider else None
    if cap is not None:
        seconds = min(seconds, cap)
    req = BarrierStatus(
        request_id=barrier_id(reason, pod.name),
        reason=reason,
        node=node,
        attempt=pod.attempt,
        requested_at=iso(now),
        deadline=iso(now + timedelta(seconds=seconds)),
        state="Requested",
    )
    b.act(RequestBarrier(req))
    b.update(barrier=req)
    return req


def _past_deadline(b: _Builder, barrier: BarrierStatus) -> bool:
    deadline = parse_time(barrier.deadline)
    return deadline is not None and b.world.now > deadline


_SUSPEND_STOPPING = "suspending: stopping the controller"


def _committed(b: _Builder, barrier: BarrierStatus, first: bool) -> None:
    """A barrier committed (`first`: seen for the first time): misses and failures are history."""
    if first:
        b.event("Normal", "BarrierCommitted", f"barrier {barrier.request_id} committed cut {barrier.cut_id}")
    for ctype in ("BarrierMissed", "BarrierFailed"):
        if b.has_condition(ctype):
            b.condition(ctype, False, "Committed", f"barrier {barrier.request_id} committed cut {barrier.cut_id}")


def _failed(b: _Builder, barrier: BarrierStatus) -> None:
    """The controller answered that it could not cut: say so once (the condition holds it)."""
    cond = next((c for c in b.st.conditions if c.type == "BarrierFailed"), None)
    message = f"barrier {barrier.request_id} failed: {barrier.message or 'no reason given'}"
    if cond is not None and cond.status == "True" and cond.message == message:
        return
    last = b.st.last_cut.id if b.st.last_cut else "none yet"
    b.condition("BarrierFailed", True, "CutFailed", message)
    b.event("Warning", "BarrierFailed", f"{message}; falling back to the newest committed cut ({last})")


def _missed(b: _Builder, barrier: BarrierStatus) -> None:
    last = b.st.last_cut.id if b.st.last_cut else "none yet"
    b.update(barrier=barrier.model_copy(update={"state": "Missed"}))
    b.condition(
        "BarrierMissed",
        True,
        "DeadlineExceeded",
        f"barrier {barrier.request_id} missed its deadline {barrier.deadline}",
    )
    b.event(
        "Warning",
        "BarrierMissed",
        f"barrier {barrier.request_id} did not commit by {barrier.deadline}; "
        f"falling back to the newest committed cut ({last})",
    )


# ----------------------------------------------------------------------------- worker pods


def _tend_workers(b: _Builder, plan: Plan) -> None:
    """Worker pods follow the controller whose Ray head they join; see the module docstring."""
    world = b.world
    head = b.st.ray_head
    live = sorted((p for p in world.pods if p.deleting_since is None), key=lambda p: p.attempt)
    current = live[-1] if live else None
    stopping = {a.name for a in plan.actions if isinstance(a, DeletePod)}
    serving = (
        current is not None
        and current.phase == "Running"
        and current.name not in stopping
        and current.node not in world.lost_nodes
        and head is not None
        and head.attempt == current.attempt
        and not world.spec.suspend
        and b.st.phase not in ("Succeeded", "Failed", "Suspended")
    )
    if head is None and not world.workers and not world.spec.generation.worker_pods:
        return  # a job without worker pods: nothing to tend, nothing to report

    acted = False
    lost: list[str] = []
    ended = 0
    ready = 0
    by_index: dict[int, list[PodView]] = {}
    attempt = current.attempt if serving and current is not None else None
    count = head.workers if head is not None else 0
    for w in world.workers:
        wanted = w.attempt == attempt and w.index is not None and 0 <= w.index < count
        if w.node is not None and w.node in world.lost_nodes:
            # Nothing to save on a worker, and its deterministic name must be free for the
            # replacement: no waiting for a node that may never confirm anything.
            b.act(DeletePod(w.name, force=True))
            acted = True
            if wanted:
                lost.append(f"{w.name}: node {w.node} stopped answering")
        elif not wanted:
            if w.deleting_since is None:
                b.act(DeletePod(w.name))
                acted = True
        elif w.phase in ("Succeeded", "Failed"):
            if w.deleting_since is None:
                b.act(DeletePod(w.name))
                acted = True
            code = f" with exit code {w.exit_code}" if w.exit_code is not None else ""
            lost.append(f"{w.name}: ended {w.phase}{code}")
            ended += 1
        elif w.deleting_since is not None:
            lost.append(f"{w.name}: being deleted")
        elif w.phase == "Running":
            ready += 1
        if wanted and w.index is not None:
            by_index.setdefault(w.index, []).append(w)

    # A worker that ended by itself backs off before its replacement. One backoff covers every
    # worker that ends within it (and holds any other missing pod back until it is over); the
    # ended pod seen again (a stale cache) is not counted twice.
    retry_after = parse_time(b.st.worker_retry_after)
    wait = max(0.0, (retry_after - world.now).total_seconds()) if retry_after is not None else 0.0
    new_backoff = serving and ended > 0 and wait == 0
    if new_backoff:
        wait = worker_backoff(world.spec, b.st.worker_backoff_seconds, retry_after, world.now)
        b.update(
            worker_restarts=b.st.worker_restarts + 1,
            worker_retry_after=iso(world.now + timedelta(seconds=wait)),
            worker_backoff_seconds=wait,
        )
    if attempt is not None and head is not None:
        missing = [i for i in range(count) if not by_index.get(i)]
        if missing and wait > 0:
            plan.requeue_within(wait)
        elif missing:
            b.act(*(CreateWorkerPod(attempt, i, head.address, world.avoid_nodes) for i in missing))
            acted = True
    before = world.status.workers_ready or 0
    b.update(workers_ready=ready)
    if serving and lost and (ready < before or new_backoff):
        when = f"in {wait:.0f} s" if wait > 0 else "now"
        b.event(
            "Warning",
            "WorkerLost",
            f"{'; '.join(lost)}. Its groups go back to the other workers; a replacement pod is created {when} "
            "(not a preemption: no barrier, no restore)",
        )
    if acted:
        plan.requeue_within(1.0)
