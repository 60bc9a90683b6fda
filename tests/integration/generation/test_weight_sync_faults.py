"""The weight sync that nothing can hang, driven through its lifecycle on gloo with failpoints at
each transition (:mod:`spotrl_runtime.generation.sync_lifecycle`): real Ray workers (a member
SIGKILLed before it announces and mid-send, a member slow past the bound, a barrier during the
sync, a member whose drain outlasts the bound) and a real sender process SIGKILLed mid-send.

Each ends with the next successful sync within the channel's timeout, the sender (this process)
alive, the healthy workers not replaced, and the channel's process groups destroyed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_generation_pool_ray import SPEC, drain, perturbed_weights, requests, until

from spotrl_runtime.generation import GroupGenerated
from spotrl_runtime.generation.pool import GenerationPool, SyncResult
from spotrl_runtime.generation.weights import (
    ChannelAddress,
    ChannelHost,
    ChannelMember,
    WeightSender,
    WeightSyncCancelledError,
    WeightSyncError,
    live_links,
    policy_plan,
    unique_tensors,
)


def faulty_pool(marks: Path, failpoints: str, workers: int = 2) -> GenerationPool:
    """Workers whose processes hold at ``failpoints`` (each writes its pid to ``marks``)."""
    env = {"SPOTRL_FAILPOINTS": failpoints, "SPOTRL_FAILPOINT_DIR": str(marks), "OMP_NUM_THREADS": "1"}
    options = {"num_cpus": 0.5, "runtime_env": {"env_vars": env}}
    pool = GenerationPool(SPEC, num_workers=workers, max_in_flight_groups=2, max_restarts=1, actor_options=options)
    pool.wait_ready(timeout=180)
    return pool


def held(marks: Path, name: str, timeout: float = 120) -> int:
    """The pid of the process holding at failpoint ``name``."""
    until(lambda: (marks / name).exists(), f"a process at {name}", timeout)
    return int(json.loads((marks / name).read_text())["pid"])


def release(marks: Path, name: str) -> None:
    """Ends the hold, and lets any later process (a replacement) pass the point at once."""
    (marks / f"{name}.release").touch()


def in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as err:  # checked by the test
            out["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def sender_of(weights: dict[str, torch.Tensor], timeout: float) -> WeightSender:
    """Small buckets: a sync is many collectives, so a fault lands between two of them."""
    return WeightSender(lambda: weights, "float32", ChannelHost("127.0.0.1", timeout=timeout), 4096)


def recover(pool: GenerationPool, sender: WeightSender, version: int, deadline: float) -> SyncResult:
    """Joiner syncs until one succeeds (the healthy members re-form in a new epoch)."""
    while True:
        assert time.monotonic() < deadline, "no successful sync within the channel's timeout"
        result = pool.sync_joiners(sender, version)
        if result is not None and not result.failed:
            return result
        pool.poll(timeout=0.2)


def settled(pool: GenerationPool, sender: WeightSender, before: int) -> None:
    """Every worker back, holding the version, with one channel group at most; the sender's groups
    destroyed: this process holds no more of them than the ``before`` the test began with (an
    earlier test's failed epoch may still be retiring: gloo frees it at its timeout)."""
    import ray

    sender.channel.close()
    until(lambda: live_links() <= before, "the sender's groups destroyed", 60)
    for state in pool.workers():
        assert state["alive"], state
        groups = ray.get(pool.actor(state["worker"]).info.remote())["channel_groups"]
        assert groups <= 1, f"{state['worker']} holds {groups} of the channel's groups"


def generates_with(pool: GenerationPool, version: int) -> None:
    pool.submit(requests(0, 4))
    outcomes = drain(pool, 4)
    assert all(isinstance(o, GroupGenerated) and o.weight_version == version for o in outcomes), outcomes


@pytest.mark.parametrize(
    "point",
    [
        pytest.param("weights.announce", id="before-it-announces"),
        pytest.param("weights.received", id="mid-send"),
    ],
)
def test_a_member_sigkilled_ends_the_epoch_and_the_next_sync_comes_within_the_timeout(
    ray_session: Any, tmp_path: Path, point: str
) -> None:
    """gen-0 (rank 1) is SIGKILLed where ``point`` holds it: before it says it is ready, or
    after its first bucket. The sync fails at once (not at the 60 s timeout), gen-0 is replaced
    and its groups would be redispatched; gen-1 re-forms in a new epoch and syncs."""
    before = live_links()
    pool = faulty_pool(tmp_path, f"{point}@1=120")
    try:
        weights = perturbed_weights(1)
        sender = sender_of(weights, timeout=60)
        assert len(sender.plan.buckets) > 4
        pool.give(1)
        thread, out = in_thread(lambda: pool.sync(1, sender))
        pid = held(tmp_path, point)
        assert pid == pool.workers()[0]["pid"], "the member at rank 1 holds"
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        release(tmp_path, point)
        thread.join(90)
        result = out.get("result")
        assert isinstance(result, SyncResult), out
        assert result.failed, "the sync did not succeed for a member that died in it"
        assert time.monotonic() - killed < 30, "the sync ended long before the channel's 60 s timeout"
        recover(pool, sender, 1, killed + 60)
        pool.wait_ready(timeout=120)  # gen-0's replacement joins too
        if any(not w["synced"] for w in pool.workers()):
            recover(pool, sender, 1, time.monotonic() + 60)
        states = {w["worker"]: w for w in pool.workers()}
        assert (states["gen-0"]["restarts"], states["gen-1"]["restarts"]) == (1, 0), "the healthy member stays"
        generates_with(pool, 1)
        settled(pool, sender, before)
    finally:
        pool.shutdown()


def test_a_member_slow_past_the_bound_is_replaced_and_the_others_sync_without_it(
    ray_session: Any, tmp_path: Path
) -> None:
    """gen-0 drained but does not announce for 120 s; the bound is 5 s: the epoch ends then,
    gen-0 is replaced (as a dead one is), gen-1 is not, and syncs in the next epoch."""
    before = live_links()
    pool = faulty_pool(tmp_path, "weights.announce@1=120")
    try:
        sender = sender_of(perturbed_weights(2), timeout=5)
        pool.give(1)
        started = time.monotonic()
        result = pool.sync(1, sender)
        took = time.monotonic() - started
        assert "did not announce it was ready for version 1 within 5 s of finishing its groups: gen-0" in result.failed
        assert 5 <= took < 60, f"the sync ended after {took:.1f} s: at the bound (5 s), not the hold (120 s)"
        release(tmp_path, "weights.announce")
        recover(pool, sender, 1, time.monotonic() + 30)
        states = {w["worker"]: w for w in pool.workers()}
        assert (states["gen-0"]["restarts"], states["gen-1"]["restarts"]) == (1, 0)
        pool.wait_ready(timeout=120)
        if any(not w["synced"] for w in pool.workers()):
            recover(pool, sender, 1, time.monotonic() + 30)
        generates_with(pool, 1)
        settled(pool, sender, before)
    finally:
        pool.shutdown()


def test_a_barrier_cancels_a_sync_at_once_and_takes_no_worker_down(ray_session: Any, tmp_path: Path) -> None:
    """A barrier while gen-0 holds before it announces: the sync is cancelled at once (its
    weights would never be used), both members end their receive, neither is replaced, and a
    joiner's sync gives them a whole version."""
    before = live_links()
    pool = faulty_pool(tmp_path, "weights.announce@1=120")
    try:
        weights = perturbed_weights(3)
        sender = sender_of(weights, timeout=60)
        barrier = threading.Event()
        pool.give(1)
        thread, out = in_thread(lambda: pool.sync(1, sender, cancelled=barrier.is_set))
        held(tmp_path, "weights.announce")
        barrier.set()
        asked = time.monotonic()
        thread.join(60)
        assert isinstance(out.get("error"), WeightSyncCancelledError), out
        assert time.monotonic() - asked < 5, "the barrier waited for the sync"
        release(tmp_path, "weights.announce")
        until(lambda: pool.poll(timeout=0.1) == [] and not any(w["synced"] for w in pool.workers()), "both ended")
        result = recover(pool, sender, 1, time.monotonic() + 60)
        assert result.members == 2
        assert [w["restarts"] for w in pool.workers()] == [0, 0], "a barrier takes no worker down"
        generates_with(pool, 1)
        settled(pool, sender, before)
    finally:
        pool.shutdown()


def test_a_drain_longer_than_the_bound_does_not_fail_the_sync(ray_session: Any, tmp_path: Path) -> None:
    """The worker's groups of the old version take 8 s more to finish; the bound is 3 s. The
    sender's clock starts only once the member announced it drained: the sync succeeds, and
    the groups were generated by their version."""
    before = live_links()
    pool = faulty_pool(tmp_path, "worker.stepped@1=8", workers=1)
    try:
        sender = sender_of(perturbed_weights(4), timeout=3)
        started = time.monotonic()
        pool.submit(requests(0, 2, n=4, max_new_tokens=16))
        pool.give(1)
        result = pool.sync(1, sender)
        assert result.failed == ""
        assert time.monotonic() - started >= 7, "the member drained its groups first"
        old = drain(pool, 2)
        assert all(isinstance(o, GroupGenerated) and o.weight_version == 0 for o in old)
        assert pool.workers()[0]["restarts"] == 0
        generates_with(pool, 1)
        settled(pool, sender, before)
    finally:
        pool.shutdown()


SENDER = """
import sys, torch
from spotrl_runtime.generation.weights import ChannelHost, WeightSender
state = {f"w{i}": torch.full((256,), float(i)) for i in range(8)}
host = ChannelHost("127.0.0.1", timeout=60)
print(host.port, flush=True)
WeightSender(lambda: state, "float32", host, 1024).sync(1, 2, 5)
"""


def test_a_sender_sigkilled_mid_send_leaves_no_member_waiting(tmp_path: Path) -> None:
    """The sender's process dies after its second bucket: the member (this process) stops at
    once, not at the 60 s timeout, destroys the epoch's group, and takes the next sync from a
    new sender."""
    before = live_links()
    state = {f"w{i}": torch.full((256,), float(i)) for i in range(8)}
    plan = policy_plan(unique_tensors(state), "float32", 1024)
    assert len(plan.buckets) == 8
    env = {**os.environ, "SPOTRL_FAILPOINTS": "weights.send@1=120", "SPOTRL_FAILPOINT_DIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", SENDER], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        member = ChannelMember()
        member.join(ChannelAddress("127.0.0.1", port, 1, 1, 2, "gloo", 60))
        thread, out = in_thread(lambda: member.receive(plan, 5, lambda pairs: None))
        assert held(tmp_path, "weights.send") == proc.pid
        proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        thread.join(60)
        assert isinstance(out.get("error"), WeightSyncError), out
        assert time.monotonic() - killed < 30, "the member waited for a dead sender"
        host = ChannelHost("127.0.0.1", timeout=60)
        sender = WeightSender(lambda: state, "float32", host, 1024)
        got: dict[str, torch.Tensor] = {}
        member.join(host.address(1, 2, 1))
        thread, out = in_thread(lambda: member.receive(plan, 6, lambda pairs: got.update(dict(pairs))))
        assert sender.sync(1, 2, 6) == plan.nbytes
        thread.join(60)
        assert out.get("result") == plan.nbytes, out
        assert time.monotonic() - killed < 60, "the next sync came within the channel's timeout"
        assert set(got) == set(state)
        host.close()
        member.close()
        until(lambda: live_links() <= before, "every group of both epochs destroyed", 60)
    finally:
        proc.kill()
        proc.wait(10)
