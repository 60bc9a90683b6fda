"""The RLJob lifecycle as a pure function: what the world looks like → what to do next.

The operator is level-triggered: on every event and on a short timer it observes the job,
its controller pods and the nodes under them (a :class:`~spotrl_operator.world.World`),
calls :func:`reconcile`, and applies the returned :class:`~spotrl_operator.world.Plan`.
Everything the decision needs to survive an operator restart is on the RLJob's status,
never in memory, so a new operator replica reaches the same plan from the same world and
neither loses nor repeats a barrier.

The barrier protocol (notice → ``Requested`` → the controller's ``Committed``, ``Failed``
or the operator's ``Missed`` → let go → a fresh controller) is told once, in
docs/concepts/barriers-and-notices.md; here it is :func:`_running` and :func:`_suspend`, with
:class:`~spotrl_operator.world.RequestBarrier`, ``OpenDisruptionBudget``, ``DeletePod``,
``CreateControllerPod`` and ``CloseDisruptionBudget``.

Attempts: ``status.attempt`` is written before the pod of that attempt is created, and
``status.controllerPod`` only once the pod has been seen. An attempt whose pod was never
seen (the operator stopped in between, or its cache lags) is created again under the same
deterministic name instead of counting a new attempt, so a restart neither loses nor
repeats a controller.

Worker pods (``spec.generation.workerPods``) follow the controller: :mod:`spotrl_operator.workers`.
Trainer pods (``spec.training.parallelism.trainerPods``) follow it too
(:mod:`spotrl_operator.trainers`), and losing one is a preemption: a notice on a trainer pod's
node asks for a barrier here as one on the controller's node does, and a controller that
exits with :data:`~spotrl_runtime.api.rljob.EXIT_RANK_LOST` is preempted, not crashed.
What the lifecycle decides on and returns (:class:`~spotrl_operator.world.World`,
:class:`~spotrl_operator.world.Plan`, the actions): :mod:`spotrl_operator.world`.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta

from spotrl_operator import queueing, recovery
from spotrl_operator.cut_risk import tend_barrier_risk
from spotrl_operator.learning_signal import tend_learning_signal
from spotrl_operator.standby import tend_standby, usable
from spotrl_operator.trainers import tend_trainers, trainer_notices
from spotrl_operator.workers import tend_workers
from spotrl_operator.world import (
    Builder,
    CloseDisruptionBudget,
    CreateControllerPod,
    DeletePod,
    EnsureChildren,
    OpenDisruptionBudget,
    Plan,
    PodView,
    PromoteStandby,
    RequestBarrier,
    World,
)
from spotrl_runtime.api import times
from spotrl_runtime.api.rljob import (
    EXIT_RANK_LOST,
    EXIT_REFUSED,
    BarrierStatus,
    FailureBudget,
    RecoveryMarks,
    RLJobStatus,
)

# A pod stuck in Terminating on a node whose kubelet stopped answering is never confirmed
# gone; after this long we force-delete it so a fresh controller can start.
LOST_NODE_TERMINATING_GRACE = timedelta(seconds=5)


# ----------------------------------------------------------------------------- helpers


def barrier_id(reason: str, pod: str) -> str:
    """Deterministic, so two operator replicas (or a restarted one) ask for the same barrier."""
    return hashlib.sha256(f"{pod}|{reason}".encode()).hexdigest()[:12]


def crash_backoff(budget: FailureBudget, restarts: int) -> float:
    """Seconds before retry number `restarts` (1-based): doubling, capped."""
    return float(min(budget.max_backoff_seconds, budget.backoff_seconds * 2 ** max(0, restarts - 1)))


# ----------------------------------------------------------------------------- reconcile


def reconcile(world: World) -> Plan:
    """The next step of the job's lifecycle. Pure: the same world gives the same plan."""
    b = Builder(world)
    b.plan.requeue_after = _lifecycle(b)
    tend_workers(b)
    tend_trainers(b)
    tend_barrier_risk(b)
    tend_learning_signal(b)
    tend_standby(b)
    return b.finish()


def _lifecycle(b: Builder) -> float | None:
    """The controller's lifecycle (the worker and trainer pods follow it: :func:`~spotrl_operator.workers.tend_workers`,
    :func:`~spotrl_operator.trainers.tend_trainers`).
    Returns when to look again (seconds; None: at the next period)."""
    world = b.world
    # A job failed for its configuration is no job for Kueue: no Workload (in a namespace the
    # operator may be refused), and the next pass, Failed, finishes one it had.
    b.held = queueing.tend(b) if not world.config_error else None
    if b.st.phase in ("Succeeded", "Failed"):
        return None

    live = sorted((p for p in world.pods if p.deleting_since is None), key=lambda p: p.attempt)
    for stale in live[:-1]:  # never two controllers
        b.act(DeletePod(stale.name))
    for p in world.pods:
        stuck = p.deleting_since is not None and world.now - p.deleting_since >= LOST_NODE_TERMINATING_GRACE
        if stuck and p.node in world.lost_nodes:
            b.act(DeletePod(p.name, force=True))
    current = live[-1] if live else None
    if current is not None and current.attempt < b.st.attempt:
        # A view behind the status (a pod cache that lags a fresh read): an older attempt's pod,
        # not yet seen deleting, is never the job's controller. Taking it for one would count its
        # crash again, ask it for a barrier, or make the next pass think the real one vanished.
        b.act(DeletePod(current.name))
        return 1.0
    if current is not None:
        b.update(controller_pod=current.name, controller_node=current.node)
        if current.standby and current.deleting_since is None:
            b.act(PromoteStandby(current.name))  # promoted, but the label is still on: again
    _account_time_lost(b)
    _note_skipped_cuts(b)
    _note_storage_conflict(b)
    _note_version_skew(b)
    _note_paused_force_deletes(b)
    if world.missing_children:
        b.act(EnsureChildren(world.missing_children))

    if world.config_error:
        for p in live:
            b.act(DeletePod(p.name))
        b.condition("Failed", True, "InvalidConfiguration", world.config_error)
        b.phase("Failed", world.config_error)
        return None

    if current is not None and current.phase in ("Succeeded", "Failed"):
        return _finished(b, current)
    if b.stopping:
        return _suspend(b, current)
    if current is None:
        return _start(b)
    return _running(b, current)


def _account_time_lost(b: Builder) -> None:
    """A fresh controller has trained its first step: the interruption is over."""
    st = b.st
    interrupted = times.parse(st.interrupted_at)
    # The interrupted controller may still report steps (a missed barrier) until it is gone:
    # only a later attempt's step ends the interruption.
    later = st.step_attempt is not None and st.step_attempt == st.attempt > (st.interrupted_attempt or 0)
    if interrupted is not None and later:
        lost = (b.world.now - interrupted).total_seconds()
        b.update(
            seconds_lost=round(st.seconds_lost + max(0.0, lost), 3),
            interrupted_at=None,
            interrupted_attempt=None,
            training_since=times.rfc3339(b.world.now),
        )
        b.event("Normal", "Resumed", f"training again after {lost:.0f} s; {st.preemptions} preemption(s) survived")
        _recovered(b, lost)


def _recovered(b: Builder, lost: float) -> None:
    """The new attempt trained its first step: the operator's marks, the fresh pod's
    scheduling and the controller's times become ``lastRecovery``, said once in an Event."""
    st = b.st
    if st.recovering is None:  # a crash restart or a resume after suspend: not a preemption
        return
    pod = next((p for p in b.world.pods if p.attempt == st.attempt), None)
    rec = recovery.compose(
        st.recovering, st.attempt_times, st.attempt, pod.scheduled_at if pod else None, b.world.now, lost
    )
    b.update(last_recovery=rec, recovering=None)
    b.event("Normal", "Recovered", recovery.describe(rec))


def _note_skipped_cuts(b: Builder) -> None:
    """The current controller skipped damaged cuts to resume: a Warning Event (once) and the
    ``CutSkipped`` condition, until an attempt resumes without skipping any."""
    resume = b.st.resume
    if resume is None or resume.attempt != b.st.attempt:
        return
    if not resume.skipped:
        if b.has_condition("CutSkipped"):
            b.condition("CutSkipped", False, "ResumedFromNewestCut", f"attempt {resume.attempt} skipped no cut")
        return
    message = (
        f"attempt {resume.attempt} resumed from cut {resume.cut_id or '(none: a new run)'}, skipping damaged "
        + ", ".join(f"{s.id} ({s.check}: {s.message[:160]})" for s in resume.skipped)
        + "; the steps after it are trained again"
    )[:1000]
    said = any(c.type == "CutSkipped" and c.status == "True" and c.message == message for c in b.st.conditions)
    if not said:
        b.event("Warning", "CutSkipped", message)
    b.condition("CutSkipped", True, "DamagedCut", message)


def _note_paused_force_deletes(b: Builder) -> None:
    """Too many nodes unhealthy at once: the ``ForceDeletesPaused`` condition (and a Warning)
    while the operator waits instead of force-deleting the job's pods on them."""
    why = b.world.force_deletes_paused
    if why:
        if not b.has_condition("ForceDeletesPaused"):
            b.event("Warning", "ForceDeletesPaused", why)
        b.condition("ForceDeletesPaused", True, "ManyNodesUnhealthy", why)
    elif b.has_condition("ForceDeletesPaused"):
        b.condition("ForceDeletesPaused", False, "NodesAnswer", "no longer too many nodes unhealthy at once")


def _note_storage_conflict(b: Builder) -> None:
    """An older RLJob's storage overlaps this one's: the ``StorageConflict`` condition (and a
    Warning Event, once), until it is fixed. :func:`_start` starts no controller meanwhile."""
    conflict = b.world.storage_conflict
    if conflict is not None:
        if not b.has_condition("StorageConflict"):
            b.event("Warning", "StorageConflict", conflict)
        b.condition("StorageConflict", True, "StorageShared", conflict)
    elif b.has_condition("StorageConflict"):
        b.condition("StorageConflict", False, "OwnStorage", "no other RLJob's storage overlaps this job's")


def _note_version_skew(b: Builder) -> None:
    """Fields of the stored job this version does not know (a newer CRD defaulted them, or a newer
    operator or controller wrote them) were skipped: the job runs on what this version knows, and
    ``VersionSkew`` says what was skipped, with a Warning Event once."""
    skipped = b.world.skipped_fields
    if skipped:
        shown = ", ".join(skipped[:10]) + (f" and {len(skipped) - 10} more" if len(skipped) > 10 else "")
        message = (
            f"this operator skipped fields it does not know: {shown}; the CRD, another operator or the "
            "controller is newer: run one version of SpotRL (docs/operations/upgrading.md)"
        )
        if not b.has_condition("VersionSkew"):
            b.event("Warning", "VersionSkew", message)
        b.condition("VersionSkew", True, "FieldsSkipped", message)
    elif b.has_condition("VersionSkew"):
        b.condition("VersionSkew", False, "FieldsKnown", "this operator knows every field of the job")


def _held(b: Builder) -> bool:
    """Whether no controller may start now: the storage is shared with an older job, or this
    spec's controller refused its storage (exit 3). A changed spec lifts the refusal."""
    st, world = b.st, b.world
    if world.storage_conflict is not None:
        b.phase("Pending", world.storage_conflict)
        return True
    if st.refused_generation is None:
        return False
    if st.refused_generation == world.generation:
        b.phase("Pending", st.message or "the controller refused its storage")
        return True
    b.update(refused_generation=None)
    again = f"the spec changed (generation {world.generation}): trying again"
    b.condition("StorageRefused", False, "SpecChanged", again)
    return False


def _refused(b: Builder, pod: PodView) -> float | None:
    """The controller refused its storage (exit 3): a configuration error, not a crash. Said
    once; no restart counted and none made until the spec changes."""
    if b.st.refused_generation == b.world.generation:
        return None  # said already: a pass whose pod cache has not seen the deletion yet
    why = pod.exit_message or "the run cannot start from its storage"
    msg = (
        f"controller {pod.name} refused its storage: {why}; fix spec.checkpoint.storage (or the store), then "
        "change the spec to try again (e.g. suspend and resume the job)"
    )[:1000]
    b.update(refused_generation=b.world.generation, retry_after=None)
    b.event("Warning", "StorageRefused", msg)
    b.condition("StorageRefused", True, "Refused", msg)
    b.phase("Pending", msg)
    return None


def _finished(b: Builder, pod: PodView) -> float | None:
    world, spec = b.world, b.world.spec
    if pod.phase == "Succeeded" and (b.st.step or 0) >= spec.training.total_steps:
        b.condition("Complete", True, "Trained", f"trained {spec.training.total_steps} steps")
        b.phase("Succeeded", f"trained {spec.training.total_steps} steps")
        return None
    b.act(DeletePod(pod.name))
    if pod.phase == "Failed" and pod.exit_code == EXIT_REFUSED:
        return _refused(b, pod)
    if pod.phase == "Failed" and pod.exit_code == EXIT_RANK_LOST:
        b.interrupted()
        why = f" ({pod.exit_message})" if pod.exit_message else ""
        b.event(
            "Warning",
            "TrainerLost",
            f"controller {pod.name} exited with code {EXIT_RANK_LOST}: a trainer rank was lost without notice{why}; "
            "the next attempt resumes from the newest committed cut (a preemption, not a crash)",
        )
        b.phase("Rescheduling", f"attempt {pod.attempt} lost a trainer rank; resuming from the newest committed cut")
        return 1.0
    if pod.phase == "Failed" and pod.rejected:
        # Never ran: no crash of the program and no work lost; start the attempt again at once
        # (a retry_after of now: _start counts neither a crash nor a preemption).
        b.update(retry_after=times.rfc3339(world.now))
        b.event(
            "Warning",
            "ControllerRejected",
            f"the kubelet on node {pod.node} failed {pod.name} before it started ({pod.rejected}); starting again",
        )
        b.phase("Rescheduling", f"controller {pod.name} was rejected by node {pod.node}; starting again")
        return 1.0
    if _is_preemption(pod, world):
        b.interrupted()
        b.phase("Rescheduling", f"controller {pod.name} was stopped on node {pod.node} ({pod.disruption or 'node'})")
        return 1.0
    if b.st.retry_after is not None:
        # This crash was counted already: a pass whose pod cache has not seen the deletion yet
        # (or a restarted operator) finds the same failed pod again. The next attempt clears it.
        return 1.0
    restarts = b.st.restarts + 1
    why = (
        f"exit code {pod.exit_code}" + (f": {pod.exit_message}" if pod.exit_message else "")
        if pod.phase == "Failed"
        else f"exited 0 after {b.st.step or 0} of {spec.training.total_steps} steps"
    )
    b.update(restarts=restarts)
    if restarts > spec.failure_budget.max_crashes:
        budget = spec.failure_budget.max_crashes
        msg = f"controller crashed {restarts} times (last: {why}); failureBudget.maxCrashes is {budget}"
        b.condition("Failed", True, "FailureBudgetExhausted", msg)
        b.phase("Failed", msg)
        return None
    wait = crash_backoff(spec.failure_budget, restarts)
    b.update(retry_after=times.rfc3339(world.now + timedelta(seconds=wait)))
    b.event(
        "Warning",
        "ControllerCrashed",
        f"{pod.name} crashed ({why}); retry {restarts} of {spec.failure_budget.max_crashes} in {wait:.0f} s",
    )
    b.phase("Rescheduling", f"controller crashed ({why}); retrying in {wait:.0f} s")
    return 1.0


def _is_preemption(pod: PodView, world: World) -> bool:
    """A pod that ended because its node went away, not because its program failed."""
    if pod.disruption:
        return True
    if pod.node and pod.node in world.unusable_nodes | world.lost_nodes:
        return True
    barrier = world.status.barrier
    return barrier is not None and barrier.state in ("Requested", "Committed", "Missed")


def _may_still_write(st: RLJobStatus, pod: PodView, world: World) -> bool:
    """Whether the fresh controller must wait for ``pod``, which is being deleted, to exit: its
    SIGTERM may still be writing a cut that the fresh one must resume from. Not after its
    barrier cut committed: from then on it makes no more moves (a SIGTERM is answered with the
    same cut), its status writes test its attempt, and the fence that the next attempt claims
    refuses anything it might still write. So the fresh controller starts while the old pod
    terminates (the pod of an older attempt than the status's was let go that way already), and
    not for a pod on a lost node (nobody will confirm its exit: it is force-deleted)."""
    if pod.node in world.lost_nodes or pod.attempt < st.attempt:
        return False
    barrier = st.barrier
    return not (barrier is not None and barrier.state == "Committed" and barrier.attempt == pod.attempt)


def _suspend(b: Builder, current: PodView | None) -> float | None:
    """Stops the job through a barrier cut: ``spec.suspend``, or Kueue holds it (:attr:`Builder.held`).
    Kueue's eviction completes (the quota goes back) once no pod of the job is left."""
    world = b.world
    kueue = b.held is not None and not world.spec.suspend
    doing = "evicted by Kueue" if kueue else "suspending"
    if current is None:
        if any(p.deleting_since is not None for p in world.pods):
            b.phase("Checkpointing", f"{doing}: waiting for the controller to exit")
            return 1.0
        if b.held is not None:
            queueing.settle(b)
        if kueue:
            b.phase("Queued", b.held or "queued")
            return None
        b.phase("Suspended", "suspended; set spec.suspend=false to resume from the last cut")
        return None
    # A barrier already asked of this controller (a notice came first) serves the suspend
    # too: asking again would make it cut twice.
    barrier = b.st.barrier
    if barrier is None:
        reason = queueing.BARRIER_REASON if kueue else "suspend"
        req = _new_barrier(b, reason, current, node=None, provider="suspend")
        b.event("Normal", "BarrierRequested", f"{doing}: barrier {req.request_id} requested")
        b.phase("Checkpointing", f"{doing}: waiting for the barrier cut")
        return 1.0
    if barrier.state == "Requested" and not _past_deadline(b, barrier):
        b.phase("Checkpointing", f"{doing}: waiting for the barrier cut")
        return 1.0
    if barrier.state == "Requested":
        _missed(b, barrier)
    elif barrier.state == "Failed":
        _failed(b, barrier)
    elif barrier.state == "Committed":
        _committed(b, barrier)
    b.act(DeletePod(current.name))
    b.phase("Checkpointing", f"{doing}: stopping the controller")
    return 1.0


def _start(b: Builder) -> float | None:
    world, st = b.world, b.st
    blocking = [p for p in world.pods if p.deleting_since is not None and _may_still_write(st, p, world)]
    if blocking:
        # The previous controller may still be writing its SIGTERM cut; a new one must see it.
        b.phase(st.phase or "Pending", f"waiting for {blocking[0].name} to exit")
        return 1.0
    refused = st.refused_generation is not None
    if _held(b):
        return None
    retry_after = times.parse(st.retry_after)
    if retry_after is not None and world.now < retry_after:
        return (retry_after - world.now).total_seconds()
    if st.attempt > 0 and st.controller_pod is None:
        # Attempt N is on the status but its pod was never seen: the operator stopped between
        # writing the status and creating the pod, or the pod is not in its cache yet. Create
        # it (again: the name is deterministic, a second create is a no-op) without counting
        # anything a second time.
        b.act(CreateControllerPod(st.attempt, world.avoid_nodes))
        return 1.0

    standby = next((p for p in world.standbys if p.attempt == st.attempt + 1), None)
    if standby is not None and not usable(b, standby):
        # The standby has the next attempt's name: it goes first, then a fresh pod is made
        # (at once on a node that stopped answering: nobody would confirm its exit).
        if standby.node is not None and standby.node in world.lost_nodes:
            b.act(DeletePod(standby.name, force=True))
        elif standby.deleting_since is None:
            b.act(DeletePod(standby.name))
        b.phase(st.phase or "Pending", f"waiting for the standby {standby.name} to go (it cannot take over)")
        return 1.0

    first = st.attempt == 0
    crash = retry_after is not None
    resumed_from_suspend = st.phase in ("Suspended", "Queued") or (
        st.barrier is not None and st.barrier.reason in ("suspend", queueing.BARRIER_REASON)
    )
    if not (first or crash or resumed_from_suspend or refused):
        b.interrupted()  # it vanished: evicted, drained, moved by us, or its node was lost
        for gone in (p for p in world.pods if p.attempt == st.attempt and p.node in world.lost_nodes):
            # Evicted by the taint manager before the node counted as lost (force deletes were
            # paused in its zone, say): the loss is the same as the one _running reports.
            b.event("Warning", "NodeLost", f"node {gone.node} stopped answering; no barrier is possible")
        b.update(preemptions=st.preemptions + 1)
        marks = b.st.recovering or RecoveryMarks(attempt=st.attempt)
        if marks.pod_deleted_at is None:
            marks = marks.model_copy(update={"pod_deleted_at": times.rfc3339_micro(world.now)})
        b.update(recovering=marks.model_copy(update={"standby": standby is not None}))
    elif b.st.recovering is not None:
        b.update(recovering=None)  # a crash or a suspend: no preemption to measure
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
    if standby is not None:
        # Its attempt is on the status now: it stops waiting and claims the job. The create
        # below is a no-op (the standby has the name), and kept for an operator that restarts.
        b.act(PromoteStandby(standby.name))
    b.act(CreateControllerPod(attempt, world.avoid_nodes))
    if world.pdb_open or world.pdb_stale:
        b.act(CloseDisruptionBudget())
    if first:
        b.update(training_since=times.rfc3339(world.now))
        b.event("Normal", "ControllerCreated", "controller attempt 1")
        b.phase("Pending", "starting the controller")
    elif standby is not None:
        b.event(
            "Normal",
            "StandbyPromoted",
            f"controller attempt {attempt}: the standby {standby.name} on node {standby.node} takes over, "
            "resuming from the newest committed cut",
        )
        b.phase("Rescheduling", f"the standby {standby.name} takes over as attempt {attempt}")
    else:
        b.event("Normal", "ControllerCreated", f"controller attempt {attempt}, resuming from the newest committed cut")
        b.phase("Rescheduling", f"starting controller attempt {attempt}")
    return 1.0


def _running(b: Builder, current: PodView) -> float | None:
    world = b.world
    barrier = b.st.barrier
    if current.node in world.lost_nodes:
        b.event("Warning", "NodeLost", f"node {current.node} stopped answering; no barrier is possible")
        b.act(DeletePod(current.name, force=True))
        b.interrupted()
        b.phase("Rescheduling", f"node {current.node} lost; resuming from the newest committed cut")
        return 1.0

    if barrier is not None and barrier.state == "Requested":
        if _past_deadline(b, barrier):
            _missed(b, barrier)
            b.act(OpenDisruptionBudget(), DeletePod(current.name))
            b.interrupted()
            b.phase("Rescheduling", "barrier missed its deadline; resuming from the newest committed cut")
            return 1.0
        b.phase("Checkpointing", f"barrier cut requested ({barrier.reason})")
        return 1.0
    if barrier is not None:
        # Committed: the cut is safe and the controller makes no more moves. Missed or
        # Failed: the chance is gone. Either way let the drain through and leave the node.
        if barrier.state == "Failed":
            _failed(b, barrier)
        elif barrier.state == "Committed":
            _committed(b, barrier)
        if not world.pdb_open:
            b.act(OpenDisruptionBudget())
        b.act(DeletePod(current.name))
        b.interrupted()
        moving = "the controller" if barrier.node in (None, current.node) else "the controller and its trainer pods"
        b.phase("Rescheduling", f"moving {moving} off node {barrier.node} (barrier {barrier.state.lower()})")
        return 1.0

    notices = [(s, "") for s in world.signals if s.node == current.node]
    notices += [(s, f" (trainer pod {t.name})") for s, t in trainer_notices(b, current)]
    if notices:
        # Several notices at once (AKS cordons before its own taint lands, GKE marks the pod a
        # DisruptionTarget): the barrier gets the tightest deadline any of them allows.
        sig, whose = min(notices, key=lambda n: _deadline_seconds(world, n[0].provider))
        req = _new_barrier(b, sig.reason, current, node=sig.node, provider=sig.provider, noticed=sig.since)
        b.event(
            "Warning",
            "PreemptionNotice",
            f"{sig.reason} on node {sig.node}{whose}: barrier {req.request_id} requested, deadline {req.deadline}",
        )
        b.phase("Checkpointing", f"barrier cut requested ({sig.reason}{whose})")
        return 1.0

    if world.pdb_open or world.pdb_stale:
        b.act(CloseDisruptionBudget())
    if current.phase == "Running":
        b.condition("Running", True, "ControllerRunning", f"{current.name} on node {current.node}")
        b.phase("Running", f"controller {current.name} on node {current.node}")
        return None
    b.phase(b.st.phase or "Pending", f"controller {current.name} is {current.phase}")
    return 2.0


def _deadline_seconds(world: World, provider: str) -> int:
    """A barrier's time for a notice from ``provider``: the job's deadline, capped by the
    provider's (a platform whose notice is shorter)."""
    seconds = world.spec.checkpoint.barrier_deadline_seconds
    cap = world.deadline_caps.get(provider)
    return seconds if cap is None else min(seconds, cap)


def _new_barrier(
    b: Builder, reason: str, pod: PodView, node: str | None, provider: str, noticed: datetime | None = None
) -> BarrierStatus:
    """Asks ``pod`` for a barrier cut; ``provider``: who sent the notice (its deadline cap);
    ``noticed``: when the notice began (its own time; default now)."""
    now = b.world.now
    seconds = _deadline_seconds(b.world, provider)
    req = BarrierStatus(
        request_id=barrier_id(reason, pod.name),
        reason=reason,
        node=node,
        attempt=pod.attempt,
        requested_at=times.rfc3339(now),
        deadline=times.rfc3339(now + timedelta(seconds=seconds)),
        state="Requested",
    )
    b.act(RequestBarrier(req, provider))
    b.update(barrier=req)
    if provider != "suspend":
        notice = min(noticed, now) if noticed is not None else now
        b.update(
            recovering=RecoveryMarks(
                attempt=pod.attempt,
                notice_at=times.rfc3339_micro(notice),
                requested_at=times.rfc3339_micro(now),
            )
        )
    return req


def _past_deadline(b: Builder, barrier: BarrierStatus) -> bool:
    deadline = times.parse(barrier.deadline)
    return deadline is not None and b.world.now > deadline


def _committed(b: Builder, barrier: BarrierStatus) -> None:
    """A barrier committed: misses and failures are history. The first pass that acts on the
    answer says so and marks it ``handled``, so a pass from a stale cache does not say it again."""
    if not barrier.handled:
        b.event("Normal", "BarrierCommitted", f"barrier {barrier.request_id} committed cut {barrier.cut_id}")
        b.update(barrier=barrier.model_copy(update={"handled": True}))
    marks = b.st.recovering
    if marks is not None and marks.committed_at is None and barrier.committed_at:
        b.update(recovering=marks.model_copy(update={"committed_at": barrier.committed_at}))
    for ctype in ("BarrierMissed", "BarrierFailed"):
        if b.has_condition(ctype):
            b.condition(ctype, False, "Committed", f"barrier {barrier.request_id} committed cut {barrier.cut_id}")


def _failed(b: Builder, barrier: BarrierStatus) -> None:
    """The controller answered that it could not cut: say so once (the condition holds it)."""
    cond = next((c for c in b.st.conditions if c.type == "BarrierFailed"), None)
    message = f"barrier {barrier.request_id} failed: {barrier.message or 'no reason given'}"
    if cond is not None and cond.status == "True" and cond.message == message:
        return
    last = b.st.last_cut.id if b.st.last_cut else "none yet"
    b.condition("BarrierFailed", True, "CutFailed", message)
    b.event("Warning", "BarrierFailed", f"{message}; falling back to the newest committed cut ({last})")


def _missed(b: Builder, barrier: BarrierStatus) -> None:
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
