"""The liveness endpoint tells a stuck event loop from a working one (/metrics, served by its
own thread, would answer either way)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

from spotrl_operator.metrics import Metrics


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_healthz_fails_while_the_event_loop_is_stuck_and_metrics_still_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator's own beat task on a real event loop, which then blocks (a handler that
    never yields): /healthz goes 503 because the loop stopped, not because a test rewound the
    beat, and 200 again once the loop runs. A beat from any other thread would keep it 200."""
    from spotrl_operator import handlers
    from spotrl_operator.fleet import Fleet
    from spotrl_operator.settings import Settings

    # Seconds, not the production minute: a beat every 50 ms, stale after 0.5 s.
    monkeypatch.setattr(handlers, "BEAT_SECONDS", 0.05)
    monkeypatch.setattr(Metrics, "STALL_SECONDS", 0.5)
    metrics, port = Metrics(), free_port()
    ctx = SimpleNamespace(metrics=metrics, fleet=Fleet(), settings=Settings())
    loop = asyncio.new_event_loop()
    beat = loop.create_task(handlers._beat(ctx))  # type: ignore[arg-type]
    looping = threading.Thread(target=loop.run_forever, daemon=True)
    stuck, release = threading.Event(), threading.Event()

    def block() -> None:
        stuck.set()
        release.wait(30)

    server, thread = metrics.serve(port, "127.0.0.1")
    looping.start()
    try:
        assert get(port, "/healthz") == (200, b"ok\n")
        loop.call_soon_threadsafe(block)
        assert stuck.wait(5)
        time.sleep(1.0)  # twice the stall
        code, body = get(port, "/healthz")
        assert code == 503, body
        assert b"has not run for" in body
        assert get(port, "/metrics")[0] == 200
        release.set()
        deadline = time.monotonic() + 5  # the loop beats again: fresh within a beat
        while get(port, "/healthz")[0] != 200:
            assert time.monotonic() < deadline, "the loop runs again but /healthz stays 503"
            time.sleep(0.05)
    finally:
        release.set()
        loop.call_soon_threadsafe(beat.cancel)
        loop.call_soon_threadsafe(loop.stop)
        looping.join(5)
        server.shutdown()
        thread.join(5)


@pytest.mark.parametrize("path", ["/", "/metrics"])
def test_other_paths_are_the_metrics(path: str) -> None:
    metrics, port = Metrics(), free_port()
    server, thread = metrics.serve(port, "127.0.0.1")
    try:
        code, body = get(port, path)
        assert code == 200
        assert b"spotrl_operator_pass_seconds" in body
    finally:
        server.shutdown()
        thread.join(5)
