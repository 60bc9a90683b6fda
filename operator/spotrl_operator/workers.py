"""Worker pods (``spec.generation.workerPods``), pure: they follow the controller whose Ray head
they join.

A controller that wants its generation workers in pods of their own publishes its Ray head
in ``status.rayHead`` (address, attempt, how many workers). While that controller runs,
:func:`tend_workers` keeps one pod per worker index of its attempt: it creates a missing one
(:class:`~spotrl_operator.world.CreateWorkerPod`, deterministic name, so a second create is a
no-op), deletes one that ended so that it is created again after a backoff
(``failureBudget``'s doubling wait, see :func:`worker_backoff`; ``status.workerRestarts``
counts them for the attempt, so a worker that crashes at once is not recreated in a hot
loop), and force-deletes one whose node stopped answering, at once and without a backoff (a
worker holds nothing to save, and its node is no fault of it). A worker stopped by its node's
going (the pod's ``DisruptionTarget`` condition: a spot node's graceful shutdown, a drain, a
taint eviction) is no fault of it either: it is replaced at once, on another node, and not
counted.

Losing a worker is **not** a preemption of the job: no barrier, no new controller, nothing
counted against the failure budget's crashes; the controller sends the lost worker's groups
to the other workers. Workers of any other attempt, and every worker once the controller
stops, suspends, finishes or fails, are deleted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from spotrl_operator.world import Builder, CreateWorkerPod, DeletePod
from spotrl_runtime.api import times
from spotrl_runtime.api.rljob import RLJobSpec


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


@dataclass
class _Census:
    """The worker pods as :func:`_classify` found them."""

    deletes: list[DeletePod] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    """Why each wanted worker is not working, for the WorkerLost Event."""
    ended: int = 0
    """Wanted workers that ended by themselves (they back off)."""
    ready: int = 0
    present: set[int] = field(default_factory=set)
    """Indexes of the serving attempt that have a pod."""


def tend_workers(b: Builder) -> None:
    """Worker pods follow the controller whose Ray head they join; see the module docstring."""
    world, head = b.world, b.st.ray_head
    if head is None and not world.workers and not world.spec.generation.worker_pods:
        return  # a job without worker pods: nothing to tend, nothing to report
    attempt = b.serving_attempt()
    census = _classify(b, attempt)
    b.act(*census.deletes)
    wait, new_backoff = _backoff(b, census, serving=attempt is not None)
    created = _create(b, census, attempt, wait)
    before = world.status.workers_ready or 0
    b.update(workers_ready=census.ready)
    if attempt is not None and census.lost and (census.ready < before or new_backoff):
        when = f"in {wait:.0f} s" if wait > 0 else "now"
        b.event(
            "Warning",
            "WorkerLost",
            f"{'; '.join(census.lost)}. Its groups go back to the other workers; a replacement pod is created "
            f"{when} (not a preemption: no barrier, no restore)",
        )
    if census.deletes or created:
        b.plan.requeue_within(1.0)


def _classify(b: Builder, attempt: int | None) -> _Census:
    """Which worker pods go (lost nodes, other attempts, ended), which count, which indexes are there."""
    world, head = b.world, b.st.ray_head
    count = head.workers if head is not None else 0
    out = _Census()
    for w in world.workers:
        wanted = w.attempt == attempt and w.index is not None and 0 <= w.index < count
        if w.node is not None and w.node in world.lost_nodes:
            # Nothing to save on a worker, and its deterministic name must be free for the
            # replacement: no waiting for a node that may never confirm anything.
            out.deletes.append(DeletePod(w.name, force=True))
            if wanted:
                out.lost.append(f"{w.name}: node {w.node} stopped answering")
        elif not wanted:
            if w.deleting_since is None:
                out.deletes.append(DeletePod(w.name))
        elif w.phase in ("Succeeded", "Failed"):
            if w.deleting_since is None:
                out.deletes.append(DeletePod(w.name))
            if w.disruption is not None:
                # Ended by its node's going (a spot node's shutdown, a drain): no fault of the
                # worker, so no backoff and no restart counted, as for a lost node.
                out.lost.append(f"{w.name}: stopped by its node's disruption ({w.disruption})")
            else:
                code = f" with exit code {w.exit_code}" if w.exit_code is not None else ""
                out.lost.append(f"{w.name}: ended {w.phase}{code}")
                out.ended += 1
        elif w.deleting_since is not None:
            out.lost.append(f"{w.name}: being deleted")
        elif w.phase == "Running":
            out.ready += 1
        if wanted and w.index is not None:
            out.present.add(w.index)
    return out


def _backoff(b: Builder, census: _Census, serving: bool) -> tuple[float, bool]:
    """(seconds until replacements may be created, whether a new backoff starts now).

    A worker that ended by itself backs off before its replacement. One backoff covers every
    worker that ends within it (and holds any other missing pod back until it is over); the
    ended pod seen again (a stale cache) is not counted twice."""
    world = b.world
    retry_after = times.parse(b.st.worker_retry_after)
    wait = max(0.0, (retry_after - world.now).total_seconds()) if retry_after is not None else 0.0
    new_backoff = serving and census.ended > 0 and wait == 0
    if new_backoff:
        wait = worker_backoff(world.spec, b.st.worker_backoff_seconds, retry_after, world.now)
        b.update(
            worker_restarts=b.st.worker_restarts + 1,
            worker_retry_after=times.rfc3339(world.now + timedelta(seconds=wait)),
            worker_backoff_seconds=wait,
        )
    return wait, new_backoff


def _create(b: Builder, census: _Census, attempt: int | None, wait: float) -> bool:
    """Creates the serving attempt's missing worker pods, unless a backoff runs. True if it did."""
    head = b.st.ray_head
    if attempt is None or head is None:
        return False
    missing = [i for i in range(head.workers) if i not in census.present]
    if missing and wait > 0:
        b.plan.requeue_within(wait)
        return False
    b.act(*(CreateWorkerPod(attempt, i, head.address, b.world.avoid_nodes) for i in missing))
    return bool(missing)
