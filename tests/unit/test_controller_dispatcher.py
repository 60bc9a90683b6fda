"""The controller's dispatcher thread waits, not spins, while there is nothing to wait on.

With the lookahead gate closed (the trainer has not committed the step that opens it) and
no actor call in flight, :meth:`GenerationPool.poll` returns at once. A dispatcher that
loops straight back burns a core and the GIL that the trainer and the generation workers
need (on the tiny job it slowed training down markedly: docs/benchmarks.md). Here the
pool is a counting stand-in; the owners, the loader and the loop are the real ones.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml
from core.scripted_generation import new_owners

from spotrl_runtime.api.rljob import parse_rljob
from spotrl_runtime.controller.assemble import ControllerOptions, Parts
from spotrl_runtime.controller.loop import Controller
from spotrl_runtime.core.owners import RecoveryConfig

ROOT = Path(__file__).resolve().parents[2]


class CountingPool:
    """Takes every group and answers none: nothing is ever in flight, as between steps."""

    def __init__(self) -> None:
        self.polls = 0
        self.submitted: list[str] = []

    def submit(self, requests: Any) -> None:
        self.submitted.extend(r.group_id for r in requests)

    def poll(self, timeout: float | None = 0.0) -> list[Any]:
        self.polls += 1
        return []

    def calls_in_flight(self) -> int:
        return 0

    def freeze(self) -> list[int]:
        return []


class Tokenizer:
    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}


def _controller(pool: CountingPool) -> Controller:
    job = parse_rljob(yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text()))
    owners = new_owners(RecoveryConfig.from_spec(job.spec))
    trainer = type("Trainer", (), {"step": 0})()
    parts: Any = Parts(
        storage=None,  # type: ignore[arg-type]
        audit=None,  # type: ignore[arg-type]
        tokenizer=Tokenizer(),
        reward=None,  # type: ignore[arg-type]
        encode=lambda prompt: tuple(ord(c) for c in prompt.text),
        trainer=trainer,
        owners=owners,
        writer=SimpleNamespace(base=None),  # type: ignore[arg-type]
        pool=pool,  # type: ignore[arg-type]
        ray=None,  # type: ignore[arg-type]
        resumed_from=None,
        fence=None,  # type: ignore[arg-type]
    )
    return Controller(job, ControllerOptions(storage_uri="unused"), parts)


def test_with_the_gate_closed_and_nothing_in_flight_the_dispatcher_sleeps_and_a_ring_wakes_it() -> None:
    pool = CountingPool()
    controller = _controller(pool)
    thread = threading.Thread(target=controller._dispatch_loop, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 5
        while not pool.submitted and time.monotonic() < deadline:
            time.sleep(0.01)
        # Steps 0 and 1 (lookahead 1) went out; the gate stays closed until step 0 is trained.
        assert len(pool.submitted) == 2 * 16, pool.submitted
        before = pool.polls
        time.sleep(1.0)
        idle_polls = pool.polls - before
        # Waiting 50 ms a round: about 20 in a second. A spinning loop polls thousands of times.
        assert 5 <= idle_polls <= 60, idle_polls

        # Parked and rung, as request_barrier does: the dispatcher stops within one wait.
        controller._parked.set()
        controller._wake.set()
        thread.join(timeout=1.0)
        assert not thread.is_alive(), "the dispatcher did not stop after the barrier"
    finally:
        controller._stop.set()
        controller._wake.set()
        thread.join(timeout=2)
