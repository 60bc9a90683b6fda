"""Trainer pods (``spec.training.parallelism.trainerPods``), pure: one per trainer rank, each a
Ray node that joins the controller's head and offers one rank's slot.

A controller with trainer pods publishes its Ray head in ``status.rayHead`` with the number of
``trainers`` (its ranks). While that controller runs, and through a suspend's barrier cut (its
ranks write their shards of the cut), :func:`tend_trainers` creates one pod per index of its
attempt (:class:`~spotrl_operator.world.CreateTrainerPod`, deterministic name, so a second
create is a no-op) until every one has been seen once (``status.trainersAttempt``).

Losing a trainer rank **is** a preemption of the trainer group, unlike losing a generation
worker (:mod:`spotrl_operator.workers`):

- a notice on a trainer pod's node (:func:`trainer_notices`) is a notice for the job: the
  lifecycle asks the controller for a barrier cut as for a notice on its own node, the
  PodDisruptionBudget holds the trainer pods with the controller until the cut commits, and a
  fresh attempt (controller and trainer pods) starts away from the noticed node;
- without notice (the pod ended, was deleted, its node stopped answering) the controller
  exits with :data:`~spotrl_runtime.api.rljob.EXIT_RANK_LOST`, which the lifecycle treats as
  a preemption. So a trainer pod that goes is never created again under the same attempt:
  one that ended is left to its controller (and to ``kubectl logs``); one whose node stopped
  answering is force-deleted (nothing is left to save there).

Trainer pods of any other attempt, and every one once the controller stops, suspends,
finishes or fails, are deleted.
"""

from __future__ import annotations

from spotrl_operator.signals import Signal
from spotrl_operator.world import Builder, CreateTrainerPod, DeletePod, PodView


def trainer_notices(b: Builder, controller: PodView) -> list[tuple[Signal, PodView]]:
    """Notices for the trainer pods of ``controller``'s attempt: signals on their nodes, and
    DisruptionTarget on the pods. A node that stopped answering gives none: no barrier can
    be cut without the rank there (the controller exits with EXIT_RANK_LOST instead)."""
    world = b.world
    out: list[tuple[Signal, PodView]] = []
    for t in sorted(world.trainers, key=lambda t: t.name):
        if t.attempt != controller.attempt or t.node is None or t.node in world.lost_nodes:
            continue
        out += [(s, t) for s in world.signals if s.node == t.node]
        if t.disruption:
            out.append((Signal("disruption-target", t.node, t.disruption), t))
    return out


def tend_trainers(b: Builder) -> None:
    """Trainer pods follow the controller whose Ray head they join; see the module docstring."""
    world, head = b.world, b.st.ray_head
    if not world.trainers and not world.spec.training.parallelism.trainer_pods and not (head and head.trainers):
        return  # a job without trainer pods: nothing to tend, nothing to report
    attempt = b.serving_attempt(through_suspend=True)
    count = head.trainers if head is not None and attempt is not None else 0
    ready, present, lost = 0, set(), []
    for t in world.trainers:
        wanted = t.attempt == attempt and t.index is not None and 0 <= t.index < count
        if t.node is not None and t.node in world.lost_nodes:
            b.act(DeletePod(t.name, force=True))
            if wanted:
                lost.append(f"{t.name}: node {t.node} stopped answering")
        elif not wanted:
            if t.deleting_since is None:
                b.act(DeletePod(t.name))
        elif t.phase in ("Succeeded", "Failed"):
            code = f" with exit code {t.exit_code}" if t.exit_code is not None else ""
            lost.append(f"{t.name}: ended {t.phase}{code}")
        elif t.deleting_since is not None:
            lost.append(f"{t.name}: being deleted")
        elif t.phase == "Running":
            ready += 1
        if wanted and t.index is not None:
            present.add(t.index)
    before = world.status.trainers_ready or 0
    b.update(trainers_ready=ready)
    if attempt is not None and lost and ready < before:
        b.event(
            "Warning",
            "TrainerLost",
            f"{'; '.join(lost)}. A trainer rank lost without notice stops the trainer group: the controller "
            "exits and the next attempt resumes from the newest committed cut (a preemption)",
        )
    if attempt is None or head is None or b.st.trainers_attempt == attempt:
        return  # nothing wanted, or every pod of this attempt was created once already
    missing = [i for i in range(count) if i not in present]
    if not missing:
        b.update(trainers_attempt=attempt)
        return
    b.act(*(CreateTrainerPod(attempt, i, head.address, world.avoid_nodes) for i in missing))
    b.plan.requeue_within(1.0)
