"""The liveness endpoint tells a stuck event loop from a working one (/metrics, served by its
own thread, would answer either way)."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

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


def test_healthz_fails_once_the_loop_stops_beating_while_metrics_still_answer() -> None:
    metrics, port = Metrics(), free_port()
    server, thread = metrics.serve(port, "127.0.0.1")
    try:
        assert get(port, "/healthz") == (200, b"ok\n")
        metrics.beat -= Metrics.STALL_SECONDS + 1  # the loop last beat over a minute ago
        code, body = get(port, "/healthz")
        assert code == 503
        assert b"has not run for" in body
        assert get(port, "/metrics")[0] == 200
        metrics.beating()
        assert get(port, "/healthz")[0] == 200
    finally:
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
