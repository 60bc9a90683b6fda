"""A generation worker's streaming protocol on the demo policy (transformers, in this process):
ordered calls taken in their sequence order, a receive that waits for the groups before it,
an abort that leaves no group behind, and the pool's per-worker budget."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from spotrl_runtime import failpoints
from spotrl_runtime.generation import BackendSpec, GenerationRequest, GroupGenerated, GroupLost, GroupOutcome
from spotrl_runtime.generation.pool import DEFAULT_IN_FLIGHT_GROUPS, KV_OVERCOMMIT, has_room
from spotrl_runtime.generation.transformers_backend import TransformersBackend
from spotrl_runtime.generation.weights import ChannelHost, WeightSender
from spotrl_runtime.generation.worker import GenerationWorker

PROMPTS = ["3+4=", "9-2=", "7+8=", "5+5=", "6-6="]
SPEC = BackendSpec(kind="transformers", model="builtin:tiny-arith")


@pytest.fixture
def worker(tiny_arith: tuple[Any, Any]) -> Iterator[GenerationWorker]:
    model, tok = tiny_arith
    backend = TransformersBackend(copy.deepcopy(model), tok)
    backend.batch_groups = 1  # a step per group: a failpoint can hold between them
    w = GenerationWorker(SPEC, "w0", backend)
    yield w
    w.stop()


@pytest.fixture
def held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The worker's thread holds after its first step until ``<tmp>/worker.stepped.release``."""
    monkeypatch.setenv("SPOTRL_FAILPOINTS", "worker.stepped@1=60")
    monkeypatch.setenv("SPOTRL_FAILPOINT_DIR", str(tmp_path))
    monkeypatch.setattr(failpoints, "_spec", None)
    return tmp_path


def _requests(tok: Any, count: int, first: int = 0) -> list[GenerationRequest]:
    return [
        GenerationRequest(f"g{i}", tuple(tok(PROMPTS[i % len(PROMPTS)])["input_ids"]), n=2, max_new_tokens=6, seed=i)
        for i in range(first, first + count)
    ]


def _collect(worker: GenerationWorker, count: int) -> list[GroupOutcome]:
    outcomes: list[GroupOutcome] = []
    deadline = time.monotonic() + 60
    while len(outcomes) < count:
        assert time.monotonic() < deadline, f"{len(outcomes)} of {count} outcomes"
        outcomes.extend(worker.collect(timeout=0.5))
    return outcomes


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never arrived"
        time.sleep(0.02)


def _alive_after(thread: threading.Thread, seconds: float = 0.3) -> bool:
    thread.join(seconds)
    return thread.is_alive()


def test_ordered_calls_take_effect_in_sequence_order(worker: GenerationWorker, tiny_arith: tuple[Any, Any]) -> None:
    _, tok = tiny_arith
    later = threading.Thread(target=worker.submit, args=(1, _requests(tok, 2, first=2)))
    later.start()
    assert _alive_after(later), "call 1 ran before call 0"
    assert worker.submit(0, _requests(tok, 2)) == 2
    later.join(10)
    assert not later.is_alive()
    assert sorted(o.group_id for o in _collect(worker, 4)) == ["g0", "g1", "g2", "g3"]
    with pytest.raises(ValueError, match="ordered call 1 came after call 1"):
        worker.submit(1, _requests(tok, 1, first=9))


def test_a_receive_waits_for_the_groups_submitted_before_it(
    worker: GenerationWorker, tiny_arith: tuple[Any, Any], held: Path
) -> None:
    model, tok = tiny_arith
    worker.submit(0, _requests(tok, 3))
    _wait_for(held / "worker.stepped")  # one group done, two in the backend
    new = {k: v + 0.5 for k, v in model.state_dict().items()}
    channel = ChannelHost("127.0.0.1", timeout=30)
    sender = WeightSender(lambda: new, "float32", channel, 1 << 20)
    send = threading.Thread(target=sender.sync, args=(1, 2, 7), daemon=True)
    send.start()
    receive = threading.Thread(
        target=worker.receive_weights, args=(1, channel.address(1, 2, 1).to_dict(), sender.plan.to_dict(), 7)
    )
    receive.start()
    assert _alive_after(receive), "the receive did not wait for the groups before it"
    assert worker.weight_version() == 0
    (held / "worker.stepped.release").touch()
    before = _collect(worker, 3)
    receive.join(60)
    send.join(60)
    assert [o.weight_version for o in before if isinstance(o, GroupGenerated)] == [0, 0, 0]
    assert worker.weight_version() == 7
    worker.submit(2, _requests(tok, 1, first=5))
    (after,) = _collect(worker, 1)
    assert isinstance(after, GroupGenerated)
    assert after.weight_version == 7
    assert torch.equal(worker.backend.model.state_dict()["lm_head.weight"], new["lm_head.weight"])  # type: ignore[attr-defined]


def test_an_abort_returns_every_unfinished_group_as_lost_once(
    worker: GenerationWorker, tiny_arith: tuple[Any, Any], held: Path
) -> None:
    _, tok = tiny_arith
    worker.submit(0, _requests(tok, 4))
    _wait_for(held / "worker.stepped")
    aborted = worker.abort()
    (held / "worker.stepped.release").touch()
    outcomes = _collect(worker, 4)
    assert sorted(o.group_id for o in outcomes) == ["g0", "g1", "g2", "g3"]
    assert sorted(aborted) == ["g1", "g2", "g3"]
    assert all(isinstance(o, GroupLost) and o.reason == "aborted" for o in outcomes if o.group_id in aborted)
    assert worker.collect(timeout=0.3) == [], "an aborted group came back twice"
    # The worker goes on: the same ids are taken again.
    worker.submit(1, _requests(tok, 4)[1:])
    assert all(isinstance(o, GroupGenerated) for o in _collect(worker, 3))


def test_the_pools_budget_per_worker() -> None:
    assert has_room([], 10**9, max_groups=1, kv_cache_tokens=10), "a worker with nothing takes any group"
    assert has_room([5] * 3, 5, max_groups=4, kv_cache_tokens=None)
    assert not has_room([5] * 4, 5, max_groups=4, kv_cache_tokens=10**9), "maxInFlightGroups comes first"
    kv = 1000
    assert has_room([500] * 3, KV_OVERCOMMIT * kv - 1500, max_groups=None, kv_cache_tokens=kv)
    assert not has_room([500] * 3, KV_OVERCOMMIT * kv - 1499, max_groups=None, kv_cache_tokens=kv)
    assert has_room([1] * (DEFAULT_IN_FLIGHT_GROUPS - 1), 1, max_groups=None, kv_cache_tokens=None)
    assert not has_room([1] * DEFAULT_IN_FLIGHT_GROUPS, 1, max_groups=None, kv_cache_tokens=None)
