"""The weight channel over gloo, with the sender and its members as threads of this process:
buckets, dtype, version checks on arrival, a cancelled sync, a lost member."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch

from spotrl_runtime.generation.weights import (
    ChannelHost,
    ChannelMember,
    SyncPlan,
    TensorMeta,
    WeightSender,
    WeightSyncCancelledError,
    WeightSyncError,
    live_links,
    plan_buckets,
    send,
    unique_tensors,
)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {
        "embed.weight": torch.randn(64, 16, generator=g),
        "layers.0.q.weight": torch.randn(16, 16, generator=g),
        "layers.0.q.bias": torch.randn(16, generator=g),
        "layers.1.q.weight": torch.randn(16, 16, generator=g),
        "norm.weight": torch.randn(16, generator=g),
    }
    state["lm_head.weight"] = state["embed.weight"]  # tied: travels once
    return state


def test_buckets_keep_order_stay_under_the_size_and_a_large_tensor_travels_alone() -> None:
    metas = [TensorMeta("a", (10,), "float32"), TensorMeta("b", (100,), "float32"), TensorMeta("c", (5,), "bfloat16")]
    plan = plan_buckets(metas, bucket_bytes=64)
    assert [[t.name for t in b.tensors] for b in plan.buckets] == [["a"], ["b"], ["c"]]
    assert plan.nbytes == 40 + 400 + 10
    plan = plan_buckets(metas, bucket_bytes=1000)
    assert len(plan.buckets) == 1
    assert plan.buckets[0].nbytes == 450
    assert SyncPlan.from_dict(plan.to_dict()) == plan
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(metas, 0)


def test_a_tied_tensor_travels_once() -> None:
    assert [n for n, _ in unique_tensors(_state())] == list(_state())[:-1]


def _members(
    host: ChannelHost, n: int, epoch: int, plan: SyncPlan, version: int, out: list[Any]
) -> list[threading.Thread]:
    def run(rank: int) -> None:
        got: dict[str, torch.Tensor] = {}
        member = ChannelMember()
        try:
            member.join(host.address(epoch, n + 1, rank))
            member.receive(plan, version, lambda pairs: got.update({k: v.clone() for k, v in pairs}))
            out.append(got)
        except Exception as err:
            out.append(err)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(1, n + 1)]
    for t in threads:
        t.start()
    return threads


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_members_receive_every_tensor_in_the_policy_dtype(dtype: str) -> None:
    state = _state()
    host = ChannelHost("127.0.0.1", timeout=30)
    sender = WeightSender(lambda: state, dtype, host, bucket_bytes=1024)
    assert len(sender.plan.buckets) > 2, "several buckets, so that double buffering is exercised"
    out: list[Any] = []
    threads = _members(host, 2, 1, sender.plan, 7, out)
    sent = sender.sync(1, 3, 7)
    for t in threads:
        t.join(30)
    assert sent == sender.plan.nbytes
    for got in out:
        assert isinstance(got, dict), got
        assert set(got) == set(state) - {"lm_head.weight"}
        for name, tensor in got.items():
            assert tensor.dtype == getattr(torch, dtype)
            assert torch.equal(tensor, state[name].to(getattr(torch, dtype)))


def test_a_receiver_refuses_a_version_or_bucket_it_did_not_expect() -> None:
    state = _state()
    host = ChannelHost("127.0.0.1", timeout=10)
    sender = WeightSender(lambda: state, "float32", host, bucket_bytes=2048)
    out: list[Any] = []
    threads = _members(host, 1, 1, sender.plan, version=8, out=out)  # expects 8
    host.ready(1, 8, 2)  # both ready for 8 ...
    with pytest.raises(WeightSyncError):
        sender.send(1, 2, 7)  # ... and 7 is sent: the member stops at the first header
    for t in threads:
        t.join(30)
    assert isinstance(out[0], WeightSyncError), out
    assert "version 8" in str(out[0])


def test_a_cancelled_sync_tells_its_members_and_does_not_wait_for_them() -> None:
    state = _state()
    host = ChannelHost("127.0.0.1", timeout=30)
    sender = WeightSender(lambda: state, "float32", host, bucket_bytes=2048)
    out: list[Any] = []
    threads = _members(host, 1, 1, sender.plan, 3, out)
    calls = iter(range(1000))
    host.ready(1, 3, 2)
    with pytest.raises(WeightSyncCancelledError):
        sender.send(1, 2, 3, cancelled=lambda: next(calls) >= 2)
    for t in threads:
        t.join(30)
    assert isinstance(out[0], WeightSyncCancelledError), out


def test_a_member_that_never_announces_fails_the_sync_within_the_timeout() -> None:
    state = _state()
    host = ChannelHost("127.0.0.1", timeout=2)
    sender = WeightSender(lambda: state, "float32", host, bucket_bytes=2048)
    with pytest.raises(WeightSyncError, match="did not announce it was ready for version 1 within 2 s"):
        sender.sync(1, 2, 1)


def test_a_skipped_bucket_is_refused_on_arrival() -> None:
    """The sender leaves bucket 1 out: the member expects it and refuses bucket 2 in its place."""
    state = _state()
    host = ChannelHost("127.0.0.1", timeout=10)
    sender = WeightSender(lambda: state, "float32", host, bucket_bytes=1024)
    assert len(sender.plan.buckets) >= 3
    out: list[Any] = []
    threads = _members(host, 1, 1, sender.plan, 5, out)
    torn = SyncPlan((sender.plan.buckets[0], *sender.plan.buckets[2:]))
    host.ready(1, 5, 2)
    group = host.group(1, 2)
    buckets = ({t.name: state[t.name] for t in b.tensors} for b in torn.buckets)
    with pytest.raises(WeightSyncError):
        send(group, torn, 5, buckets, timeout=5, cancelled=host.ended(1))  # the member ends the epoch
    for t in threads:
        t.join(30)
    assert isinstance(out[0], WeightSyncError), out
    assert "expected bucket 1 of version 5" in str(out[0])


def test_vllms_trainer_entry_sends_what_the_members_receive() -> None:
    """``ChannelEngine.trainer_send_weights`` (vLLM's trainer-side API) sends the plan's buckets."""
    pytest.importorskip("vllm")
    from spotrl_runtime.generation.weights import _engine_class

    state = _state()
    host = ChannelHost("127.0.0.1", timeout=30)
    plan = WeightSender(lambda: state, "bfloat16", host, bucket_bytes=1024).plan
    out: list[Any] = []
    threads = _members(host, 1, 1, plan, 4, out)
    host.ready(1, 4, 2)
    _engine_class().trainer_send_weights(iter(state.items()), {"group": host.group(1, 2), "plan": plan, "version": 4})
    for t in threads:
        t.join(30)
    assert isinstance(out[0], dict), out
    assert set(out[0]) == set(state) - {"lm_head.weight"}
    for name, tensor in out[0].items():
        assert torch.equal(tensor, state[name].to(torch.bfloat16))


def _threads() -> int:
    """This process's OS threads (gloo's are not Python's)."""
    return len(os.listdir("/proc/self/task"))


def _settle(baseline: int, timeout: float = 30.0) -> int:
    """Waits (bounded) for the reaper to destroy what was retired; the live groups then."""
    deadline = time.monotonic() + timeout
    while live_links() > baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    return live_links()


def test_every_epochs_group_is_destroyed_as_membership_churns() -> None:
    """24 epochs, members coming and going (1 to 3), every fourth epoch failed by a member whose
    load raises mid-send: each epoch's group is destroyed at both ends, so the live groups and
    the OS threads stay flat. A leak (a group not destroyed) grows both by each epoch's."""
    state = _state()
    host = ChannelHost("127.0.0.1", timeout=3)
    sender = WeightSender(lambda: state, "float32", host, bucket_bytes=1024)
    assert len(sender.plan.buckets) >= 3
    members = [ChannelMember() for _ in range(3)]
    links, threads = live_links(), _threads()
    peak = 0
    for epoch in range(1, 25):
        if epoch == 2:  # torch's, the stores' and the members' own threads are up now: the baseline
            links, threads = live_links(), _threads()
        n = 1 + epoch % 3
        broken = epoch % 4 == 0
        out: list[Any] = []

        def run(rank: int, epoch: int = epoch, n: int = n, broken: bool = broken, out: list[Any] = out) -> None:
            def load(pairs: list[tuple[str, torch.Tensor]]) -> None:
                if broken and rank == n and pairs[0][0] != "embed.weight":
                    raise RuntimeError("the engine refused a bucket")

            try:
                members[rank - 1].join(host.address(epoch, n + 1, rank))
                out.append(members[rank - 1].receive(sender.plan, epoch, load))
            except Exception as err:
                out.append(err)

        workers = [threading.Thread(target=run, args=(r,)) for r in range(1, n + 1)]
        for t in workers:
            t.start()
        if broken:
            with pytest.raises(WeightSyncError):
                sender.sync(epoch, n + 1, epoch)
        else:
            assert sender.sync(epoch, n + 1, epoch) == sender.plan.nbytes
        for t in workers:
            t.join(30)
        assert len(out) == n
        if broken:  # the others may have had every bucket before the epoch ended
            assert any(isinstance(o, WeightSyncError) and "refused a bucket" in str(o) for o in out), out
        else:
            assert out == [sender.plan.nbytes] * n, out
        peak = max(peak, live_links() - links)
    host.close()
    for member in members:
        member.close()
    assert _settle(links) <= links, f"{live_links() - links} of the channel's groups were never destroyed"
    # A healthy epoch's groups are destroyed at once; a failed one's once its pending collective
    # ends (within the timeout): never more than the current epoch's and the failed ones'.
    failed_links = sum(1 + (1 + e % 3) for e in range(1, 25) if e % 4 == 0)
    assert peak <= 4 + failed_links, f"{peak} groups alive at once: more than the current and the failed epochs'"
    deadline = time.monotonic() + 10  # gloo's threads end as their group is destroyed
    while _threads() > threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _threads() <= threads, f"{_threads() - threads} more OS threads after 24 epochs than after the first"
