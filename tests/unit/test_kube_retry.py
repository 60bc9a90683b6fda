"""spotrl_runtime.kube (the operator's and the bridge's client): an answer that says "later"
(429 or 503 with Retry-After, as a watch cache that is still filling answers) is waited out
and the request sent again, for GET, PUT and DELETE only, and within bounds in count and
time; then the KubeError. An HTTP server on the loopback plays the API server, reached
through a kubeconfig in the test's tmp_path (the product's own ``Kube.connect``), so that
urllib3's retries underneath are the ones the product runs with.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

import spotrl_runtime.kube as kube
from spotrl_runtime.kube import Kube, KubeError, retry_wait

PODS = "/api/v1/namespaces/ns/pods"
# Left to urllib3's default, the time-bound test would sleep the hour its server asks for.
pytestmark = pytest.mark.timeout(60)


@dataclass
class Script:
    """The answers, one per request (the last repeats): (HTTP status, Retry-After or None)."""

    answers: list[tuple[int, str | None]]
    seen: list[str] = field(default_factory=list)

    def next(self, method: str) -> tuple[int, str | None]:
        self.seen.append(method)
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[Script, str]]:
    """(the script, a kubeconfig for the server that follows it)."""
    script = Script([(200, None)])

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            status, retry_after = script.next(self.command)
            if status == 200:
                body = json.dumps({"kind": "PodList", "items": []}).encode()
            else:
                reason = {429: "TooManyRequests", 503: "ServiceUnavailable"}.get(status, "Forbidden")
                message = "storage is (re)initializing" if status == 429 else "no"
                body = json.dumps({"kind": "Status", "code": status, "reason": reason, "message": message}).encode()
            self.send_response(status)
            if retry_after is not None:
                self.send_header("Retry-After", retry_after)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self._answer()

        def do_PUT(self) -> None:
            self._answer()

        def do_DELETE(self) -> None:
            self._answer()

        def do_POST(self) -> None:
            self._answer()

        def do_PATCH(self) -> None:
            self._answer()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{server.server_address[1]}"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "fake", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    try:
        yield script, str(kubeconfig)
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The waits the client makes, recorded instead of slept."""
    slept: list[float] = []
    monkeypatch.setattr(kube, "_sleep", slept.append)
    return slept


def test_a_list_answered_429_is_sent_again_as_its_retry_after_asks(api: tuple[Script, str], waits: list[float]) -> None:
    script, kubeconfig = api
    script.answers = [(429, "1"), (429, "2"), (200, None)]
    assert Kube.connect(kubeconfig).get(PODS) == {"kind": "PodList", "items": []}
    # Three requests, not more: urllib3 does not retry them again underneath.
    assert script.seen == ["GET"] * 3
    assert waits == [1.0, 2.0]


def test_a_watch_and_a_503_with_retry_after_are_retried_too(api: tuple[Script, str], waits: list[float]) -> None:
    script, kubeconfig = api
    script.answers = [(503, "1"), (200, None)]
    resp = Kube.connect(kubeconfig).stream(PODS, timeout=5, watch="1")
    try:
        assert resp.status == 200
    finally:
        resp.release_conn()
    assert script.seen == ["GET", "GET"]
    assert waits == [1.0]


def test_retries_are_bounded_in_count(api: tuple[Script, str], waits: list[float]) -> None:
    script, kubeconfig = api
    script.answers = [(429, "1")]
    with pytest.raises(KubeError) as err:
        Kube.connect(kubeconfig).get(PODS)
    assert (err.value.status, err.value.retry_after) == (429, 1.0)
    assert "storage is (re)initializing" in str(err.value)
    assert len(script.seen) == 1 + kube.RETRY_LIMIT
    assert waits == [1.0] * kube.RETRY_LIMIT


def test_retries_are_bounded_in_time(api: tuple[Script, str], waits: list[float]) -> None:
    script, kubeconfig = api
    script.answers = [(429, "3600")]  # never wait an hour because the server says so
    with pytest.raises(KubeError):
        Kube.connect(kubeconfig).update(f"{PODS}/p", {"metadata": {"name": "p"}})
    assert all(w <= kube.RETRY_WAIT_MAX for w in waits)
    assert 0 < sum(waits) <= kube.RETRY_TOTAL_MAX
    assert len(script.seen) == 1 + len(waits)


@pytest.mark.parametrize(
    ("method", "answer"),
    [
        ("POST", (429, "1")),  # an eviction's 429 is the PodDisruptionBudget's answer
        ("PATCH", (429, "1")),
        ("GET", (429, None)),  # no Retry-After: not a "later"
        ("GET", (403, "1")),
    ],
)
def test_what_is_not_retried(api: tuple[Script, str], waits: list[float], method: str, answer: tuple[int, str]) -> None:
    script, kubeconfig = api
    script.answers = [answer, (200, None)]
    body = None if method == "GET" else {"kind": "Eviction" if method == "POST" else "Pod"}
    with pytest.raises(KubeError) as err:
        Kube.connect(kubeconfig).request(method, f"{PODS}/p/eviction" if method == "POST" else PODS, body)
    assert err.value.status == answer[0]
    assert script.seen == [method]
    assert waits == []


def test_retry_wait() -> None:
    later = KubeError("GET", PODS, 429, "TooManyRequests", "storage is (re)initializing", retry_after=2)
    assert retry_wait("GET", later, 0, 0) == 2
    assert retry_wait("DELETE", later, 0, 0) == 2
    assert retry_wait("GET", later, kube.RETRY_LIMIT, 0) is None
    assert retry_wait("GET", later, 1, kube.RETRY_TOTAL_MAX - 1) is None  # the next wait would go past the total
    long = KubeError("GET", PODS, 429, "TooManyRequests", "x", retry_after=30)
    assert retry_wait("GET", long, 0, 0) == kube.RETRY_WAIT_MAX
    assert retry_wait("POST", later, 0, 0) is None
    assert retry_wait("GET", KubeError("GET", PODS, 429, "TooManyRequests", "x"), 0, 0) is None
    assert retry_wait("GET", KubeError("GET", PODS, 0, "Unreachable", "refused", retry_after=1), 0, 0) is None
