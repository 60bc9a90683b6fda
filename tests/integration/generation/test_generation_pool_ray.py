"""Generation workers as real Ray actors: dispatch, weight sync over the channel (gloo), per-group
failures, lost workers."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace
from typing import Any

import pytest
import torch

from spotrl_e2e.procs import process_state
from spotrl_runtime.generation import (
    BackendSpec,
    GenerationRequest,
    GroupFailed,
    GroupGenerated,
    GroupLost,
    GroupOutcome,
)
from spotrl_runtime.generation.pool import GenerationPool, GenerationPoolError, SyncResult
from spotrl_runtime.generation.weights import ChannelHost, WeightSender, WeightSyncCancelledError
from spotrl_runtime.models import build_char_tokenizer, load_policy

SPEC = BackendSpec(kind="transformers", model="builtin:tiny-arith", torch_threads=1)
# Half a logical CPU each, so that the shared pool and a test's own pool fit in Ray's 2 CPUs.
OPTIONS = {"num_cpus": 0.5}
TOKENIZER = build_char_tokenizer()
PROBLEMS = [f"{a}+{b}=" for a in range(10) for b in range(10)]


def requests(
    first: int, count: int, *, n: int = 4, max_new_tokens: int = 8, temperature: float = 1.0
) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            f"g{i}",
            tuple(TOKENIZER(PROBLEMS[i % len(PROBLEMS)])["input_ids"]),
            n=n,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=i,
        )
        for i in range(first, first + count)
    ]


def drain(pool: GenerationPool, expected: int, timeout: float = 120.0) -> list[GroupOutcome]:
    """Polls until ``expected`` outcomes arrived."""
    outcomes: list[GroupOutcome] = []
    deadline = time.monotonic() + timeout
    while len(outcomes) < expected:
        assert time.monotonic() < deadline, f"only {len(outcomes)} of {expected} outcomes after {timeout}s"
        outcomes.extend(pool.poll(timeout=1.0))
    return outcomes


def perturbed_weights(seed: int) -> dict[str, torch.Tensor]:
    model, _ = load_policy("builtin:tiny-arith")
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, tensor in model.state_dict().items():
        noise = torch.randn(tensor.shape, generator=generator) * 0.3 if "norm" not in name else 0.0
        weights[name] = tensor + noise
    return weights


def sender_of(weights: dict[str, torch.Tensor], bucket_bytes: int = 1 << 20) -> WeightSender:
    """A sender of ``weights`` (float32) from this process, as the trainer's is."""
    return WeightSender(lambda: weights, "float32", ChannelHost("127.0.0.1", timeout=30), bucket_bytes)


def update(pool: GenerationPool, weights: dict[str, torch.Tensor], version: int) -> SyncResult:
    """Gives the pool ``version`` and sends it (what the controller's two threads do)."""
    pool.give(version)
    return pool.sync(version, sender_of(weights))


@pytest.fixture(scope="module")
def shared_pool(ray_session: Any) -> Any:
    """Two workers for the tests that kill none (starting workers costs seconds each)."""
    pool = GenerationPool(SPEC, num_workers=2, max_in_flight_groups=4, max_restarts=0, actor_options=OPTIONS)
    pool.wait_ready()
    yield pool
    pool.shutdown()


@pytest.fixture
def v0(shared_pool: GenerationPool) -> int:
    """The version the shared pool holds the initial weights as, for one test: versions only
    grow, so each test gets a new one (and its own versions above it)."""
    assert shared_pool.in_flight() == 0
    assert shared_pool.queued() == 0
    model, _ = load_policy("builtin:tiny-arith")
    version = shared_pool.version() + 100
    update(shared_pool, model.state_dict(), version)
    return version


@pytest.fixture
def pool(shared_pool: GenerationPool, v0: int) -> GenerationPool:
    """The shared pool, idle, with the initial weights as version ``v0``."""
    return shared_pool


def test_two_workers_generate_every_group_once(pool: GenerationPool, v0: int) -> None:
    pool.submit(requests(0, 12))
    # Each worker is sent its budget at once (max_in_flight_groups 4); the rest wait for room.
    assert (pool.in_flight(), pool.queued()) == (8, 4)
    outcomes = drain(pool, 12)
    assert [w["peak_in_flight"] for w in pool.workers()] == [4, 4]
    assert sorted(o.group_id for o in outcomes) == sorted(f"g{i}" for i in range(12))
    assert all(isinstance(o, GroupGenerated) for o in outcomes)
    assert {o.worker for o in outcomes if isinstance(o, GroupGenerated)} == {"gen-0", "gen-1"}
    assert all(len(o.samples) == 4 and o.weight_version == v0 for o in outcomes if isinstance(o, GroupGenerated))
    assert pool.in_flight() == 0
    assert pool.queued() == 0
    assert pool.poll(timeout=0.1) == []
    with pytest.raises(ValueError, match="g20 is already queued or in flight"):
        pool.submit(requests(20, 1) * 2)
    assert pool.queued() == 0  # all or nothing


def test_results_match_the_backend_run_in_process(pool: GenerationPool) -> None:
    from spotrl_runtime.generation import build_backend

    local = build_backend(SPEC).generate(requests(0, 3))
    pool.submit(requests(0, 3))
    remote = {o.group_id: o for o in drain(pool, 3)}
    for expected in local:
        got = remote[expected.group_id]
        assert isinstance(got, GroupGenerated)
        assert [s.completion_token_ids for s in got.samples] == [s.completion_token_ids for s in expected.samples]


def test_weight_sync_reaches_every_worker_and_stamps_the_version(pool: GenerationPool, v0: int) -> None:
    pool.submit(requests(0, 4))
    before = {o.group_id: o for o in drain(pool, 4)}
    result = update(pool, perturbed_weights(1), v0 + 1)
    assert (result.members, result.failed) == (2, "")
    assert result.bytes == sum(t.numel() * 4 for t in perturbed_weights(1).values())  # every tensor once
    assert [w["weight_version"] for w in pool.workers()] == [v0 + 1, v0 + 1]
    pool.submit(requests(0, 4, n=4))
    after = {o.group_id: o for o in drain(pool, 4)}
    assert all(isinstance(o, GroupGenerated) and o.weight_version == v0 + 1 for o in after.values())
    assert {o.worker for o in after.values() if isinstance(o, GroupGenerated)} == {"gen-0", "gen-1"}
    changed = [
        gid
        for gid in after
        if [s.completion_token_ids for s in after[gid].samples] != [s.completion_token_ids for s in before[gid].samples]  # type: ignore[union-attr]
    ]
    assert changed  # the same seeds sample differently under the new weights


def test_weights_sent_in_many_buckets_generate_what_the_same_weights_do_in_process(
    pool: GenerationPool, v0: int
) -> None:
    from spotrl_runtime.generation import build_backend
    from spotrl_runtime.generation.weights import give_weights

    weights = perturbed_weights(3)
    sender = sender_of(weights, bucket_bytes=4096)  # a bucket per tensor or two
    assert len(sender.plan.buckets) > 10
    pool.give(v0 + 7)
    pool.sync(v0 + 7, sender)
    local = build_backend(SPEC)
    give_weights(local, weights, v0 + 7)
    expected = local.generate(requests(0, 4))
    pool.submit(requests(0, 4))
    remote = {o.group_id: o for o in drain(pool, 4)}
    for e in expected:
        got = remote[e.group_id]
        assert isinstance(got, GroupGenerated)
        assert got.weight_version == v0 + 7
        assert [s.completion_token_ids for s in got.samples] == [s.completion_token_ids for s in e.samples]


def test_a_sync_cancelled_mid_way_leaves_the_workers_generating_nothing_until_they_get_a_whole_version(
    pool: GenerationPool, v0: int
) -> None:
    """What a barrier does to the weights on their way (nothing will use them): the sender stops
    at once and tells the members; their weights are torn, so they take no group (and give back
    any they had) until a joiner's sync gives them a whole version."""
    asked = []

    def cancelled() -> bool:
        asked.append(1)
        return len(asked) > 3  # three buckets are sent, then the barrier comes

    weights = perturbed_weights(4)
    pool.give(v0 + 9)
    with pytest.raises(WeightSyncCancelledError):
        pool.sync(v0 + 9, sender_of(weights, bucket_bytes=4096), cancelled=cancelled)
    until(
        lambda: pool.poll(timeout=0.1) == [] and not any(w["synced"] for w in pool.workers()),
        "the members to report their torn receive",
    )
    pool.submit(requests(0, 2))
    time.sleep(0.3)
    assert pool.in_flight() == 0, "no group goes to a worker with torn weights"
    result = pool.sync_joiners(sender_of(weights), v0 + 9)
    assert result is not None
    assert (result.members, result.failed) == (2, "")
    assert {o.weight_version for o in drain(pool, 2) if isinstance(o, GroupGenerated)} == {v0 + 9}
    assert pool.sync_joiners(sender_of(weights), v0 + 9) is None, "nobody is left to join"


def test_groups_sent_before_a_weight_update_keep_the_old_version(pool: GenerationPool, v0: int) -> None:
    pool.submit(requests(0, 4))  # 2 calls per worker: all four are at the workers already
    pool.give(v0 + 5)
    pool.submit(requests(4, 4))  # sent after the load: generated with the new version
    pool.sync(v0 + 5, sender_of(perturbed_weights(2)))
    outcomes = {o.group_id: o for o in drain(pool, 8)}
    versions = {gid: o.weight_version for gid, o in outcomes.items() if isinstance(o, GroupGenerated)}
    assert {versions[f"g{i}"] for i in range(4)} == {v0}
    assert {versions[f"g{i}"] for i in range(4, 8)} == {v0 + 5}


def test_versions_must_increase(pool: GenerationPool, v0: int) -> None:
    with pytest.raises(ValueError, match=f"weight version {v0} given after version {v0}: versions must increase"):
        pool.give(v0)
    assert pool.version() == v0


def at(version: int, reqs: list[GenerationRequest]) -> list[GenerationRequest]:
    """``reqs``, each asking for weight ``version`` (its admission version)."""
    return [replace(r, weight_version=version) for r in reqs]


def test_a_load_never_overtakes_the_requests_queued_before_it(ray_session: Any) -> None:
    """One worker with room for two calls of one group: update(v1), three requests, update(v2),
    no poll between. The third request is still in the pool's queue when v2 arrives; it must
    reach the worker before v2's load, so all three come back generated by v1."""
    pool = GenerationPool(SPEC, num_workers=1, max_in_flight_groups=2, max_restarts=0, actor_options=OPTIONS)
    try:
        pool.wait_ready()
        update(pool, perturbed_weights(1), 1)
        pool.submit(requests(0, 3, n=16, max_new_tokens=32, temperature=3.0))
        assert pool.queued() >= 1, "the third request waits in the pool's queue"
        pool.give(2)
        pool.submit(at(1, requests(3, 1)))  # admitted with v1 after v2 arrived: still before v2's load
        pool.submit(requests(4, 1))  # no version asked: the newest given
        pool.sync(2, sender_of(perturbed_weights(2)))
        outcomes = {o.group_id: o for o in drain(pool, 5)}
        versions = {gid: o.weight_version for gid, o in outcomes.items() if isinstance(o, GroupGenerated)}
        assert versions == {"g0": 1, "g1": 1, "g2": 1, "g3": 1, "g4": 2}
    finally:
        pool.shutdown()


def test_a_request_for_a_version_not_given_yet_waits_for_it(pool: GenerationPool, v0: int) -> None:
    """What a relaunched group of a resumed run asks: the weights it was admitted with, which
    the resume gives the pool after the older versions it needs first."""
    pool.submit(at(v0 + 2, requests(0, 2)) + at(v0, requests(2, 2)))
    assert pool.queued() + pool.in_flight() == 4
    early = {o.group_id: o.weight_version for o in drain(pool, 2) if isinstance(o, GroupGenerated)}
    assert early == {"g2": v0, "g3": v0}
    assert pool.queued() == 2, "held until their version is given"
    update(pool, perturbed_weights(1), v0 + 1)
    assert pool.queued() == 2
    update(pool, perturbed_weights(2), v0 + 2)
    late = {o.group_id: o.weight_version for o in drain(pool, 2) if isinstance(o, GroupGenerated)}
    assert late == {"g0": v0 + 2, "g1": v0 + 2}


def test_a_request_for_a_replaced_version_is_generated_with_the_current_one(pool: GenerationPool, v0: int) -> None:
    """A group redispatched after its worker died, once its version left the workers: the
    outcome says which version generated it, for the caller to count the mismatch."""
    update(pool, perturbed_weights(1), v0 + 1)
    pool.submit(at(v0, requests(0, 2)))
    assert {o.weight_version for o in drain(pool, 2) if isinstance(o, GroupGenerated)} == {v0 + 1}


def test_a_failing_group_is_reported_alone(pool: GenerationPool) -> None:
    bad = GenerationRequest("bad", (1, 10_000), n=2, max_new_tokens=4)
    pool.submit([*requests(0, 1), bad, *requests(1, 1)])
    outcomes = {o.group_id: o for o in drain(pool, 3)}
    assert isinstance(outcomes["bad"], GroupFailed)
    assert "IndexError" in outcomes["bad"].error
    assert isinstance(outcomes["g0"], GroupGenerated)
    assert isinstance(outcomes["g1"], GroupGenerated)


def test_a_killed_worker_loses_its_groups_and_the_other_finishes_them(ray_session: Any) -> None:
    pool = GenerationPool(SPEC, num_workers=2, max_in_flight_groups=4, max_restarts=0, actor_options=OPTIONS)
    try:
        pool.wait_ready()
        pool.submit(requests(0, 4))
        assert all(isinstance(o, GroupGenerated) for o in drain(pool, 4))
        update(pool, perturbed_weights(3), 1)

        # Long groups (hot sampling rarely stops) so the kill lands while they are in flight.
        pool.submit(requests(10, 8, n=64, max_new_tokens=48, temperature=3.0))
        held = {gid for gid, worker in pool.assignments().items() if worker == "gen-0"}
        assert held
        ray_session.kill(pool.actor("gen-0"))
        outcomes = drain(pool, 8)
        lost = {o.group_id for o in outcomes if isinstance(o, GroupLost)}
        generated = {o.group_id for o in outcomes if isinstance(o, GroupGenerated)}
        assert lost
        assert lost <= held
        assert lost | generated == {f"g{i}" for i in range(10, 18)}
        assert all(o.worker == "gen-0" and "ActorDied" in o.reason for o in outcomes if isinstance(o, GroupLost))

        # The controller redispatches the lost groups under the same ids; the survivor does them.
        by_id = {r.group_id: r for r in requests(10, 8, n=64, max_new_tokens=48, temperature=3.0)}
        pool.submit([by_id[gid] for gid in sorted(lost)])
        redone = drain(pool, len(lost))
        assert {o.group_id for o in redone} == lost
        assert all(isinstance(o, GroupGenerated) and o.worker == "gen-1" and o.weight_version == 1 for o in redone)
        states = {w["worker"]: w for w in pool.workers()}
        assert states["gen-0"]["alive"] is False
        assert states["gen-0"]["lost"] == len(lost)
        assert states["gen-1"]["alive"] is True
    finally:
        pool.shutdown()


def test_a_frozen_pool_pauses_its_local_workers_sends_nothing_and_shutdown_kills_them(ray_session: Any) -> None:
    """What a barrier does to generation: the worker stops taking CPU at once (SIGSTOP, no
    teardown beside the cut's writer), nothing more reaches it, and it dies with the pool."""
    pool = GenerationPool(SPEC, num_workers=1, max_restarts=0, actor_options=OPTIONS)
    try:
        pool.wait_ready()
        (worker,) = pool.workers()
        pid = worker["pid"]
        assert process_state(pid) in ("R", "S"), "running before"
        pool.submit(requests(0, 2, n=64, max_new_tokens=48, temperature=3.0))
        assert pool.in_flight() == 2
        assert pool.freeze() == [pid]
        until(lambda: process_state(pid) == "T", "the worker stopped")  # a signal lands when it is scheduled
        assert pool.workers()[0]["paused"] is True
        pool.submit(requests(10, 2))
        pool.give(3)  # ignored: nothing is sent to a worker any more
        with pytest.raises(WeightSyncCancelledError):
            pool.sync(3, sender_of(perturbed_weights(5)))
        time.sleep(0.5)
        assert pool.in_flight() == 2, "nothing more was sent"
        assert process_state(pid) == "T", "still paused"
        assert pool.freeze() == [pid], "idempotent"
    finally:
        pool.shutdown()
    until(lambda: process_state(pid) in (None, "Z"), "the worker killed")


def until(predicate: Any, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_lost_worker_is_replaced_and_loads_the_newest_weights(ray_session: Any) -> None:
    pool = GenerationPool(SPEC, num_workers=1, max_in_flight_groups=2, max_restarts=1, actor_options=OPTIONS)
    try:
        pool.wait_ready()
        weights = perturbed_weights(4)
        update(pool, weights, 3)
        pool.submit(requests(0, 2, n=64, max_new_tokens=48, temperature=3.0))
        ray_session.kill(pool.actor("gen-0"))
        outcomes = drain(pool, 2)
        assert all(isinstance(o, GroupLost) for o in outcomes)
        pool.submit(requests(0, 2))
        pool.wait_ready()
        assert pool.poll(timeout=0.5) == [], "the new worker holds its initial weights: it takes no group yet"
        assert pool.sync_joiners(sender_of(weights), 3) is not None  # what the trainer does between steps
        redone = drain(pool, 2)
        assert all(isinstance(o, GroupGenerated) and o.weight_version == 3 for o in redone)
        (state,) = pool.workers()
        assert state["restarts"] == 1
        assert state["alive"] is True
        assert state["weight_version"] == 3

        # Out of restarts: the next loss leaves no worker, and the pool says so instead of hanging.
        pool.submit(requests(5, 1, n=64, max_new_tokens=48, temperature=3.0))
        ray_session.kill(pool.actor("gen-0"))
        assert isinstance(drain(pool, 1)[0], GroupLost)
        with pytest.raises(GenerationPoolError, match="every generation worker is dead"):
            pool.poll(timeout=0.1)
    finally:
        pool.shutdown()


def test_a_worker_that_cannot_start_is_reported(ray_session: Any) -> None:
    broken = BackendSpec(kind="transformers", model="/nonexistent/model")
    pool = GenerationPool(broken, num_workers=1, max_restarts=0, actor_options=OPTIONS)
    try:
        with pytest.raises(
            GenerationPoolError, match=r"(?s)gen-0: failed to start.*policy\.model: '/nonexistent/model'"
        ):
            pool.wait_ready(timeout=60)
    finally:
        pool.shutdown()


def test_a_worker_whose_node_has_not_joined_gets_no_groups_and_is_waited_for(ray_session: Any) -> None:
    """An actor that asks for a resource no node offers yet (a worker pod still starting) is
    pending: groups stay queued instead of waiting behind it, and wait_ready says who is missing."""
    pool = GenerationPool(
        SPEC, num_workers=1, max_restarts=0, actor_options={**OPTIONS, "resources": {"spotrl.test/absent": 1}}
    )
    try:
        pool.submit(requests(0, 3))
        assert pool.poll(timeout=1.0) == []
        assert (pool.queued(), pool.in_flight()) == (3, 0)
        with pytest.raises(GenerationPoolError, match=r"0 of 1 generation workers started within 2 s.*gen-0"):
            pool.wait_ready(timeout=2, min_ready=1)
        (state,) = pool.workers()
        assert (state["alive"], state["ready"]) == (True, False)
    finally:
        pool.shutdown()


class _KillingWeights(dict):  # type: ignore[type-arg]
    """Weights whose one tensor, once the sender packs it, kills a worker (mid-sync)."""

    def __init__(self, weights: dict[str, torch.Tensor], trigger: str, kill: Any) -> None:
        super().__init__(weights)
        self.trigger, self.kill = trigger, kill

    def __getitem__(self, name: str) -> torch.Tensor:
        if name == self.trigger and self.kill is not None:
            self.kill()
            self.kill = None
        return super().__getitem__(name)


def test_a_worker_killed_mid_sync_ends_the_sync_at_once_and_the_pool_goes_on(ray_session: Any) -> None:
    """A worker dies halfway through a sync: the sender fails within seconds (not the channel's
    timeout), tells the other member, which drops its torn weights; the dead worker's
    replacement and the survivor then get a whole version and generate with it."""
    pool = GenerationPool(SPEC, num_workers=2, max_in_flight_groups=2, max_restarts=1, actor_options=OPTIONS)
    try:
        pool.wait_ready()
        weights = perturbed_weights(6)
        names = list(weights)
        (pid,) = [w["pid"] for w in pool.workers() if w["worker"] == "gen-0"]

        def kill() -> None:
            # Dead before the next bucket goes: Ray's kill only asks the raylet, and on a busy
            # machine the sender had sent every bucket by the time the worker died.
            os.kill(pid, signal.SIGKILL)
            until(lambda: process_state(pid) in (None, "Z"), "the worker killed")

        killing = _KillingWeights(weights, names[len(names) // 2], kill)
        sender = WeightSender(lambda: killing, "float32", ChannelHost("127.0.0.1", timeout=60), 4096)
        assert len(sender.plan.buckets) > 4
        pool.give(1)
        started = time.monotonic()
        result = pool.sync(1, sender)
        assert time.monotonic() - started < 30, "the sync ended long before the channel's 60 s timeout"
        assert result.failed
        until(lambda: pool.poll(timeout=0.1) == [] and not any(w["synced"] for w in pool.workers()), "both out")
        states = {w["worker"]: w for w in pool.workers()}
        assert states["gen-0"]["restarts"] == 1
        assert states["gen-1"]["restarts"] == 0, "the survivor is not replaced: it is given a whole version"
        pool.wait_ready()
        joined = pool.sync_joiners(sender_of(weights), 1)
        assert joined is not None
        assert (joined.members, joined.failed) == (2, "")
        pool.submit(requests(0, 6))
        outcomes = drain(pool, 6)
        assert all(isinstance(o, GroupGenerated) and o.weight_version == 1 for o in outcomes)
        assert {o.worker for o in outcomes if isinstance(o, GroupGenerated)} == {"gen-0", "gen-1"}
    finally:
        pool.shutdown()


def test_a_sync_whose_older_requests_only_a_restarted_worker_can_take_gives_it_the_version(ray_session: Any) -> None:
    """The only worker restarted with requests for v1 still queued before v2's load: nothing
    could move (a joiner is served by the thread that waits for v2's turn), so the sync gives the
    joiner v2, which generates the older requests too and says so."""
    pool = GenerationPool(SPEC, num_workers=1, max_in_flight_groups=1, max_restarts=1, actor_options=OPTIONS)
    try:
        pool.wait_ready()
        update(pool, perturbed_weights(1), 1)
        pool.submit(at(1, requests(0, 3, n=64, max_new_tokens=48, temperature=3.0)))
        assert pool.queued() == 2
        ray_session.kill(pool.actor("gen-0"))
        lost = drain(pool, 1)
        assert isinstance(lost[0], GroupLost)
        pool.give(2)
        result = pool.sync(2, sender_of(perturbed_weights(2)))
        assert result.members == 1, "the joiner was given v2 first; v2's own turn came after g1 and g2"
        versions = {o.group_id: o.weight_version for o in drain(pool, 2) if isinstance(o, GroupGenerated)}
        assert versions == {"g1": 2, "g2": 2}
    finally:
        pool.shutdown()


def yielding(version: int, reqs: list[GenerationRequest]) -> list[GenerationRequest]:
    """``reqs`` as a validation pass sends them: asking for ``version``, yielding to any load."""
    return [replace(r, weight_version=version, yields=True) for r in reqs]


def held_pool(tmp_path: Any, workers: int, seconds: float) -> tuple[GenerationPool, Any]:
    """A pool whose workers each hold the first batch they generate on weights 1 for
    ``seconds`` (a failpoint; touch ``<marks>/worker.generate.release`` to end it)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {
        "OMP_NUM_THREADS": "1",
        "SPOTRL_FAILPOINTS": f"worker.generate@1={seconds}",
        "SPOTRL_FAILPOINT_DIR": str(marks),
    }
    options = {**OPTIONS, "runtime_env": {"env_vars": env}}
    return GenerationPool(
        SPEC, num_workers=workers, max_in_flight_groups=1, max_restarts=0, actor_options=options
    ), marks


def test_a_validation_pass_never_delays_a_sync_and_is_generated_with_the_version_it_scores(
    ray_session: Any, tmp_path: Any
) -> None:
    """gen-0 holds the first group of a pass on v1 for two minutes, two more queued behind it
    (room for one group each): the pass stays on gen-0, v2's sync goes on at once with gen-1
    alone (the queued two sent to gen-0 first), gen-1 generates v2's groups meanwhile, and the
    whole pass comes back generated by v1. Then gen-0 is a joiner and gets v2."""
    pool, marks = held_pool(tmp_path, 2, 120)
    try:
        pool.wait_ready()
        weights = perturbed_weights(2)
        update(pool, perturbed_weights(1), 1)
        pool.submit(yielding(1, requests(0, 3)))
        until(lambda: (marks / "worker.generate").exists(), "gen-0 holding the pass", timeout=60)
        assert [w["in_flight"] for w in pool.workers()] == [1, 0], "a pass runs on one worker"
        assert pool.queued() == 2
        pool.give(2)
        started = time.monotonic()
        result = pool.sync(2, sender_of(weights))
        assert time.monotonic() - started < 60, "the sync waited for the pass"
        assert (result.members, result.failed) == (1, "")
        states = {w["worker"]: w for w in pool.workers()}
        assert (states["gen-0"]["behind"], states["gen-0"]["weight_version"], states["gen-0"]["in_flight"]) == (
            True,
            1,
            3,
        )
        assert (states["gen-1"]["behind"], states["gen-1"]["weight_version"]) == (False, 2)
        pool.submit(at(2, requests(3, 3)))
        meanwhile = drain(pool, 3)
        assert {(o.worker, o.weight_version) for o in meanwhile if isinstance(o, GroupGenerated)} == {("gen-1", 2)}
        time.sleep(0.5)
        held = time.monotonic()
        # gen-0's clock (the idle share's): generating all the while it holds the pass.
        assert pool.busy_seconds(started, held)["gen-0"] == pytest.approx(held - started, abs=0.05)
        (marks / "worker.generate.release").touch()
        passed = drain(pool, 3)
        assert {(o.worker, o.weight_version) for o in passed if isinstance(o, GroupGenerated)} == {("gen-0", 1)}
        assert len(passed) == 3
        until(lambda: [w["synced"] for w in pool.workers()] == [False, True], "gen-0 to turn joiner")
        joiner = time.monotonic()
        time.sleep(0.3)
        assert pool.busy_seconds(joiner, time.monotonic())["gen-0"] == 0.0, "idle: it waits for the weights"
        joined = pool.sync_joiners(sender_of(weights), 2)
        assert joined is not None
        assert (joined.members, joined.failed) == (1, "")
        pool.submit(at(2, requests(6, 4)))
        after = drain(pool, 4)
        assert {(o.worker, o.weight_version) for o in after if isinstance(o, GroupGenerated)} == {
            ("gen-0", 2),
            ("gen-1", 2),
        }
    finally:
        pool.shutdown()


def test_with_one_worker_a_validation_pass_is_finished_before_the_load_as_no_other_worker_could_load_it(
    ray_session: Any, tmp_path: Any
) -> None:
    """The one worker holds a pass's group on v1 for 3 s when v2's sync comes: it stays a member
    (left out, v2's group could only be generated by a joiner given a later version) and loads
    v2 after the pass."""
    pool, marks = held_pool(tmp_path, 1, 3)
    try:
        pool.wait_ready()
        update(pool, perturbed_weights(1), 1)
        pool.submit(yielding(1, requests(0, 1)))
        until(lambda: (marks / "worker.generate").exists(), "the worker holding the pass", timeout=60)
        pool.give(2)
        pool.submit(at(2, requests(1, 1)))
        result = pool.sync(2, sender_of(perturbed_weights(2)))
        assert (result.members, result.failed) == (1, "")
        assert not pool.workers()[0]["behind"]
        outcomes = {o.group_id: o for o in drain(pool, 2)}
        assert {gid: o.weight_version for gid, o in outcomes.items() if isinstance(o, GroupGenerated)} == {
            "g0": 1,
            "g1": 2,
        }
    finally:
        pool.shutdown()
