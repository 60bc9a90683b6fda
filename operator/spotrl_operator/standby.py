"""The warm standby controller (``spec.standby``), pure: when to make it, when to let it go.

A standby is the next attempt's controller pod, made early: ``<job>-controller-<N+1>`` while
attempt N trains, labelled :data:`~spotrl_operator.resources.STANDBY_LABEL`, kept off the
current controller's node and the nodes about to go. Its process does what a fresh controller
does first (imports, Ray and the generation workers, the policy loaded) and then waits for
``status.attempt`` to reach its own before it claims the job. Nothing else tells it to start:
when the lifecycle starts attempt N+1 (:func:`~spotrl_operator.reconcile._start`), it writes
``status.attempt = N+1`` as always, and creating ``<job>-controller-<N+1>`` is a no-op because
the standby already has that name. So a standby changes when the next controller starts, never
which attempt it is, and an operator that restarts halfway reaches the same place.

While it waits, a standby is not the job's controller (:func:`~spotrl_operator.observe.world_of`
puts it in :attr:`~spotrl_operator.world.World.standbys`) and the PodDisruptionBudget does not
hold it (its selector excludes the label), so a drain evicts it at once. The lifecycle takes the
label off as it promotes it (:class:`~spotrl_operator.world.PromoteStandby`).

A standby is made only while the controller trains (its first step of the attempt seen: its
start is not slowed by a second one on the same cores) and no barrier is in flight; it is let
go when the job suspends, ends or stops wanting one, when its node gets a notice, or when it
fails (then no other until the next attempt, so a standby that cannot start does not loop).
"""

from __future__ import annotations

from spotrl_operator.resources import controller_pod_name
from spotrl_operator.world import Builder, CreateControllerPod, DeletePod, PodView


def usable(b: Builder, pod: PodView) -> bool:
    """Whether ``pod`` can take over now: running, not being deleted, on a node with no notice.
    One still Pending is not: its placement was chosen against the old controller's node, which
    may now be the only one free (a crash restart)."""
    return pod.deleting_since is None and pod.phase == "Running" and pod.node not in b.world.unusable_nodes


def tend_standby(b: Builder) -> None:
    """Makes the job's standby, or lets go of one that is not wanted, and keeps
    ``status.standbyPod`` in step (named from the pass that creates it: a plan's Events go out
    with its status write, and this one would otherwise write nothing)."""
    world, st = b.world, b.st
    spec = world.spec
    if st.attempt != world.status.attempt:
        b.update(standby_pod=None)  # the lifecycle started the next attempt in this pass: its standby, if any
        return
    live = sorted((p for p in world.pods if p.deleting_since is None), key=lambda p: p.attempt)
    current = live[-1] if live else None
    stopping = {a.name for a in b.plan.actions if isinstance(a, DeletePod)}
    serving = (
        current is not None
        and current.attempt == st.attempt
        and current.phase == "Running"
        and current.name not in stopping
        and current.node not in world.unusable_nodes
    )
    wanted = spec.standby and not b.stopping and st.phase not in ("Succeeded", "Failed", "Suspended", "Queued")
    following = st.attempt + 1

    kept: PodView | None = None
    for pod in world.standbys:
        why = _let_go(b, pod, wanted, following, current)
        if why is None:
            kept = pod
            continue
        if pod.node is not None and pod.node in world.lost_nodes:
            # Nothing to save, and its name is the next attempt's: no waiting for a node that
            # may never confirm the deletion (again each pass, as a graceful one may hang).
            b.act(DeletePod(pod.name, force=True))
        elif pod.deleting_since is None:
            b.act(DeletePod(pod.name))
            if why == "failed":
                b.update(standby_failed_attempt=st.attempt)
                exit_why = f"exit code {pod.exit_code}" + (f": {pod.exit_message}" if pod.exit_message else "")
                b.event(
                    "Warning",
                    "StandbyFailed",
                    f"standby {pod.name} failed ({exit_why}); no other standby until the next attempt",
                )
    b.update(standby_pod=kept.name if kept is not None else None)

    made = any(p.attempt == following for p in world.standbys)  # also one still going: same name
    ready_to_stand_by = (
        serving
        and st.step_attempt == st.attempt
        and st.barrier is None
        and st.standby_failed_attempt != st.attempt
        and st.phase == "Running"
    )
    if wanted and ready_to_stand_by and not made and current is not None:
        avoid = world.avoid_nodes | ({current.node} if current.node else set())
        b.act(CreateControllerPod(following, frozenset(avoid), standby=True))
        # Named on the status in the same pass: that write is what carries the Event out.
        b.update(standby_pod=controller_pod_name(world.job, following))
        b.event("Normal", "StandbyCreated", f"standby controller for attempt {following}, off node {current.node}")


def _let_go(b: Builder, pod: PodView, wanted: bool, following: int, current: PodView | None) -> str | None:
    """Why the standby ``pod`` is let go (None: it is kept)."""
    if not wanted:
        return "not wanted"
    if pod.attempt != following:
        return "made for another attempt"
    if pod.phase in ("Failed", "Succeeded"):
        return "failed" if not pod.disruption and pod.node not in b.world.unusable_nodes else "stopped"
    if pod.node is not None and pod.node in b.world.unusable_nodes:
        return "its node is going"
    if current is not None and pod.node is not None and pod.node == current.node:
        return "on the controller's node"
    return None
