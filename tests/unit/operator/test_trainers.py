"""Trainer pods (training.parallelism.trainerPods), driven through the lifecycle without a
cluster: one pod per rank, each created once per attempt; a notice on a trainer pod's node is
a notice for the job (barrier, then a fresh attempt); a controller that exits with
EXIT_RANK_LOST is preempted, not crashed; trainer pods go with their controller."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from test_reconcile import SPEC, T0, events, of, running, world

from spotrl_operator.reconcile import reconcile
from spotrl_operator.signals import Signal
from spotrl_operator.world import (
    CloseDisruptionBudget,
    CreateControllerPod,
    CreateTrainerPod,
    CreateWorkerPod,
    DeletePod,
    Event,
    OpenDisruptionBudget,
    PodView,
    RequestBarrier,
    World,
)
from spotrl_runtime.api.rljob import EXIT_RANK_LOST, CutRef, RayHead, RLJobStatus, parse_spec
from spotrl_runtime.api.times import rfc3339 as iso

TRAINER_SPEC = parse_spec(
    {
        **SPEC.model_dump(by_alias=True, exclude_none=True),
        "training": {
            "totalSteps": 30,
            "parallelism": {"strategy": "fsdp", "ranks": 2, "trainerPods": True, "resources": {"cpu": "2"}},
        },
    }
)
HEAD = RayHead(address="127.0.1.2:40001", attempt=1, trainers=2)


def trainer(index: int, attempt: int = 1, node: str = "spot-b", phase: str = "Running", **kw: object) -> PodView:
    return replace(
        PodView(name=f"j-trainer-{attempt}-{index}", attempt=attempt, phase=phase, node=node, index=index),
        **kw,  # type: ignore[arg-type]
    )


def serving(**kw: object) -> World:
    """The controller of attempt 1 runs and has published its Ray head with two trainers."""
    base = world(
        spec=TRAINER_SPEC,
        status=RLJobStatus(phase="Running", attempt=1, step=3, step_attempt=1, ray_head=HEAD),
        pods=(running(),),
    )
    return replace(base, **kw)  # type: ignore[arg-type]


BOTH = (trainer(0, node="spot-b"), trainer(1, node="ondemand-a"))


def settled() -> RLJobStatus:
    """The status once both trainer pods of attempt 1 were created and seen."""
    st = reconcile(serving(trainers=BOTH)).status
    assert st is not None
    assert st.trainers_attempt == 1
    return st


def test_trainer_pods_wait_for_the_head_then_one_per_rank_is_created() -> None:
    plan = reconcile(world(spec=TRAINER_SPEC, status=RLJobStatus(phase="Pending", attempt=1), pods=(running(),)))
    assert of(plan, CreateTrainerPod) == []
    assert plan.status is not None
    assert plan.status.trainers_ready == 0
    plan = reconcile(serving(unusable_nodes=frozenset({"spot-c"}), avoid_nodes=frozenset({"spot-c"})))
    assert of(plan, CreateTrainerPod) == [
        CreateTrainerPod(1, 0, HEAD.address, frozenset({"spot-c"})),
        CreateTrainerPod(1, 1, HEAD.address, frozenset({"spot-c"})),
    ]
    assert of(plan, CreateWorkerPod) == [], "a head with trainers only asks for no worker pod"
    assert plan.requeue_after == 1.0
    assert plan.status is not None
    assert plan.status.trainers_attempt is None, "created is not seen: a refused create is tried again"
    # One is seen: the other is still created (again: the name is deterministic, a no-op if there).
    plan = reconcile(serving(trainers=(trainer(0),)))
    assert of(plan, CreateTrainerPod) == [CreateTrainerPod(1, 1, HEAD.address, frozenset())]
    # Both seen and running: nothing to do, and the status says so.
    plan = reconcile(serving(trainers=BOTH))
    assert [a for a in plan.actions if not isinstance(a, Event)] == []
    assert plan.status is not None
    assert (plan.status.trainers_ready, plan.status.trainers_attempt) == (2, 1)


def test_a_trainer_pod_that_goes_is_not_created_again_under_the_same_attempt() -> None:
    st = settled()
    ended = trainer(1, node="ondemand-a", phase="Failed", exit_code=1)
    p1 = reconcile(serving(status=st, trainers=(trainer(0), ended)))
    assert of(p1, CreateTrainerPod) == []
    assert of(p1, DeletePod) == [], "an ended trainer pod is left to its controller (and to kubectl logs)"
    assert of(p1, RequestBarrier) == []
    assert "TrainerLost" in events(p1)
    assert p1.status is not None
    assert p1.status.trainers_ready == 1
    assert (p1.status.attempt, p1.status.preemptions, p1.status.restarts) == (1, 0, 0)
    # Seen again: said once.
    assert "TrainerLost" not in events(reconcile(serving(status=p1.status, trainers=(trainer(0), ended))))
    # Gone (deleted by someone): still not created again; the controller exits 5.
    p2 = reconcile(serving(status=p1.status, trainers=(trainer(0),)))
    assert of(p2, CreateTrainerPod) == []


def test_a_trainer_pod_on_a_lost_node_is_force_deleted_without_a_barrier() -> None:
    st = settled()
    lost = frozenset({"ondemand-a"})
    plan = reconcile(serving(status=st, trainers=BOTH, lost_nodes=lost, unusable_nodes=lost))
    assert of(plan, DeletePod) == [DeletePod("j-trainer-1-1", force=True)]
    assert of(plan, RequestBarrier) == [], "no barrier can be cut without the rank on that node"
    assert of(plan, CreateTrainerPod) == []
    assert "TrainerLost" in events(plan)
    assert plan.status is not None
    assert plan.status.phase == "Running", "the controller finds its rank lost and exits 5"


def test_a_notice_on_a_trainer_pods_node_is_a_barrier_then_a_fresh_attempt_elsewhere() -> None:
    st = settled()
    notice = Signal("taint", "ondemand-a", "aws-node-termination-handler/spot-itn")
    unusable = frozenset({"ondemand-a"})
    p1 = reconcile(serving(status=st, trainers=BOTH, signals=(notice,), unusable_nodes=unusable))
    (req,) = of(p1, RequestBarrier)
    assert req.provider == "aws-node-termination-handler"
    assert (req.barrier.node, req.barrier.attempt) == ("ondemand-a", 1)
    assert req.barrier.deadline == iso(T0 + timedelta(seconds=20))
    assert of(p1, OpenDisruptionBudget) == [], "the PDB holds the trainer pods until the cut commits"
    assert of(p1, DeletePod) == [], "the ranks write their shards of the cut"
    assert p1.status is not None
    assert p1.status.phase == "Checkpointing"
    (notice_event,) = [e for e in p1.actions if getattr(e, "reason", None) == "PreemptionNotice"]
    assert "trainer pod j-trainer-1-1" in notice_event.message  # type: ignore[attr-defined]

    # The cut commits: the PDB opens, the controller and its trainer pods go.
    t1 = T0 + timedelta(seconds=3)
    committed = p1.status.model_copy(
        update={
            "barrier": req.barrier.model_copy(update={"state": "Committed", "cut_id": "c-4"}),
            "last_cut": CutRef(id="c-4", step=3, uri="s3://b/j/cuts/c-4", kind="barrier", time=iso(t1)),
        }
    )
    p2 = reconcile(serving(now=t1, status=committed, trainers=BOTH, signals=(notice,), unusable_nodes=unusable))
    assert of(p2, OpenDisruptionBudget) == [OpenDisruptionBudget()]
    assert sorted(a.name for a in of(p2, DeletePod)) == ["j-controller-1", "j-trainer-1-0", "j-trainer-1-1"]
    assert p2.status is not None
    assert "off node ondemand-a" in (p2.status.message or "")

    # The controller is gone: attempt 2, away from the noticed node; the PDB closes.
    t2 = t1 + timedelta(seconds=4)
    gone = world(
        spec=TRAINER_SPEC,
        now=t2,
        status=p2.status,
        pdb_open=True,
        unusable_nodes=unusable,
        avoid_nodes=unusable,
        trainers=(trainer(0, deleting_since=t1), trainer(1, node="ondemand-a", deleting_since=t1)),
    )
    p3 = reconcile(gone)
    assert of(p3, CreateControllerPod) == [CreateControllerPod(2, unusable)]
    assert of(p3, CloseDisruptionBudget) == [CloseDisruptionBudget()]
    assert p3.status is not None
    assert (p3.status.preemptions, p3.status.restarts, p3.status.ray_head) == (1, 0, None)

    # Attempt 2 publishes its head: its own trainer pods, kept off the noticed node.
    head2 = RayHead(address="127.0.3.4:40100", attempt=2, trainers=2)
    up = p3.status.model_copy(update={"ray_head": head2, "controller_pod": "j-controller-2"})
    p4 = reconcile(replace(gone, status=up, pods=(running(2, "spot-a"),), pdb_open=False))
    assert of(p4, CreateTrainerPod) == [
        CreateTrainerPod(2, 0, head2.address, unusable),
        CreateTrainerPod(2, 1, head2.address, unusable),
    ]


def test_a_disruption_target_on_a_trainer_pod_asks_for_a_barrier_and_another_attempts_does_not() -> None:
    st = settled()
    evicted = trainer(0, disruption="EvictionByEvictionAPI")
    p1 = reconcile(serving(status=st, trainers=(evicted, BOTH[1])))
    (req,) = of(p1, RequestBarrier)
    assert req.barrier.node == "spot-b"
    # A trainer pod of an older attempt on the controller's node, or a signal on its node: nothing.
    old = trainer(0, attempt=0, node="spot-b", disruption="EvictionByEvictionAPI", deleting_since=T0)
    old_node = Signal("cordon", "spot-c", "spec.unschedulable")
    p2 = reconcile(serving(status=st, trainers=(*BOTH, old, trainer(1, attempt=0, node="spot-c")), signals=(old_node,)))
    assert of(p2, RequestBarrier) == []
    assert sorted(a.name for a in of(p2, DeletePod)) == ["j-trainer-0-1"], "the older attempt's pods go"


def test_a_controller_that_lost_a_rank_is_preempted_not_crashed() -> None:
    st = settled()
    rank_lost = replace(
        running(), phase="Failed", exit_code=EXIT_RANK_LOST, exit_message="spotrl: trainer rank 1 was lost"
    )
    p1 = reconcile(serving(status=st, pods=(rank_lost,), trainers=(trainer(0), trainer(1, phase="Failed"))))
    assert DeletePod("j-controller-1") in of(p1, DeletePod)
    assert {DeletePod("j-trainer-1-0"), DeletePod("j-trainer-1-1")} <= set(of(p1, DeletePod))
    assert "TrainerLost" in events(p1)
    assert "ControllerCrashed" not in events(p1)
    (lost,) = [e for e in p1.actions if getattr(e, "reason", None) == "TrainerLost"]
    assert "trainer rank 1 was lost" in lost.message  # type: ignore[attr-defined]
    assert p1.status is not None
    assert (p1.status.phase, p1.status.restarts, p1.status.retry_after) == ("Rescheduling", 0, None)
    assert p1.status.interrupted_at is not None
    # The controller is gone: a new attempt at once, counted as a preemption.
    p2 = reconcile(world(spec=TRAINER_SPEC, status=p1.status))
    assert of(p2, CreateControllerPod) == [CreateControllerPod(2, frozenset())]
    assert p2.status is not None
    assert (p2.status.attempt, p2.status.preemptions, p2.status.restarts) == (2, 1, 0)
    # Any other exit code is still a crash.
    crashed = replace(running(), phase="Failed", exit_code=1)
    p3 = reconcile(serving(status=st, pods=(crashed,), trainers=BOTH))
    assert "ControllerCrashed" in events(p3)
    assert {DeletePod("j-trainer-1-0"), DeletePod("j-trainer-1-1")} <= set(of(p3, DeletePod))


def test_trainer_pods_stay_through_a_suspends_barrier_and_go_with_the_controller() -> None:
    st = settled()
    suspend = TRAINER_SPEC.model_copy(update={"suspend": True})
    p1 = reconcile(serving(spec=suspend, status=st, trainers=BOTH))
    assert of(p1, RequestBarrier)
    assert of(p1, DeletePod) == [], "the ranks write their shards of the suspend's cut"
    assert p1.status is not None
    assert p1.status.barrier is not None
    committed = p1.status.model_copy(
        update={"barrier": p1.status.barrier.model_copy(update={"state": "Committed", "cut_id": "c"})}
    )
    p2 = reconcile(serving(spec=suspend, status=committed, trainers=BOTH))
    assert sorted(a.name for a in of(p2, DeletePod)) == ["j-controller-1", "j-trainer-1-0", "j-trainer-1-1"]
    # Finished: leftovers go on any later pass.
    done = replace(running(), phase="Succeeded", exit_code=0)
    finished = RLJobStatus(phase="Succeeded", attempt=1, step=30, ray_head=HEAD, trainers_attempt=1)
    p3 = reconcile(serving(status=finished, pods=(done,), trainers=(trainer(1),)))
    assert of(p3, DeletePod) == [DeletePod("j-trainer-1-1")]


def test_a_stale_disruption_budget_is_closed_again() -> None:
    st = settled()
    assert of(reconcile(serving(status=st, trainers=BOTH, pdb_stale=True)), CloseDisruptionBudget) == [
        CloseDisruptionBudget()
    ]
    assert of(reconcile(serving(status=st, trainers=BOTH)), CloseDisruptionBudget) == []


def test_a_job_without_trainer_pods_reports_none() -> None:
    plan = reconcile(world(status=RLJobStatus(phase="Running", attempt=1), pods=(running(),)))
    assert plan.status is not None
    assert plan.status.trainers_ready is None
    assert of(plan, CreateTrainerPod) == []


def test_the_operator_reads_the_controllers_rank_lost_exit_code() -> None:
    from spotrl_runtime.controller import loop

    assert loop.EXIT_RANK_LOST == EXIT_RANK_LOST
