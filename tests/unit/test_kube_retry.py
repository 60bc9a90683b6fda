"""spotrl_runtime.kube (the operator's and the bridge's client): an answer that says "later"
is waited out and the request sent again, within bounds in count and time; then the
KubeError. A 429 for every method (its Retry-After, else 1 s) but an eviction's POST; a 503
with Retry-After for GET, PUT and DELETE only. An HTTP server on the loopback plays the API
server, reached through a kubeconfig in the test's tmp_path (the product's own
``Kube.connect``), so that urllib3's retries underneath are the ones the product runs with.

Then, against a fake ``api_client``: the rate limiter, the write guard, the Lease's
deadline client and the chunked LIST.
"""

from __future__ import annotations

import email.utils
import http.server
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

import spotrl_runtime.kube as kube
from spotrl_runtime.kube import Kube, KubeError, NotLeadingError, ServerClock, TokenBucket, retry_wait

PODS = "/api/v1/namespaces/ns/pods"
Obj = dict[str, Any]
# Left to urllib3's default, the time-bound test would sleep the hour its server asks for.
pytestmark = pytest.mark.timeout(60)


def _kubeconfig(tmp_path: Path, port: int) -> str:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "fake", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    return str(kubeconfig)


@dataclass
class Script:
    """The answers, one per request (the last repeats): (HTTP status, Retry-After or None)."""

    answers: list[tuple[int, str | None]]
    seen: list[str] = field(default_factory=list)
    skew: float = 0.0
    """Seconds the server's Date header is ahead of the real time."""

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

        def date_time_string(self, timestamp: float | None = None) -> str:
            return email.utils.formatdate(time.time() + script.skew, usegmt=True)

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
    try:
        yield script, _kubeconfig(tmp_path, server.server_address[1])
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
        ("PATCH", (503, "1")),  # a 503 may come after the write was done
        ("GET", (503, None)),  # no Retry-After: not a "later"
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
    assert retry_wait("POST", later, 0, 0) == 2  # APF's 429: the write was not processed
    assert retry_wait("PATCH", later, 0, 0) == 2
    eviction = KubeError("POST", f"{PODS}/p/eviction", 429, "TooManyRequests", "disruption budget", retry_after=2)
    assert retry_wait("POST", eviction, 0, 0) is None
    assert retry_wait("GET", KubeError("GET", PODS, 429, "TooManyRequests", "x"), 0, 0) == kube.RETRY_WAIT_429
    unavailable = KubeError("PATCH", PODS, 503, "ServiceUnavailable", "x", retry_after=1)
    assert retry_wait("PUT", unavailable, 0, 0) == 1
    assert retry_wait("PATCH", unavailable, 0, 0) is None
    assert retry_wait("POST", unavailable, 0, 0) is None
    assert retry_wait("GET", KubeError("GET", PODS, 503, "ServiceUnavailable", "x"), 0, 0) is None
    assert retry_wait("GET", KubeError("GET", PODS, 0, "Unreachable", "refused", retry_after=1), 0, 0) is None


# --- against a fake api_client ------------------------------------------------------------


def refused(status: int, retry_after: str | None = None, reason: str = "TooManyRequests") -> ApiException:
    err = ApiException(status=status, reason=reason)
    err.body = json.dumps({"kind": "Status", "code": status, "reason": reason, "message": "later"})
    err.headers = {"Retry-After": retry_after} if retry_after is not None else {}
    return err


@dataclass
class FakeApi:
    """An ``api_client``: each call takes the next answer (a dict: 200 with that JSON; an
    ApiException: raised) and records (method, path, query params, timeout)."""

    answers: list[Obj | ApiException] = field(default_factory=list)
    calls: list[tuple[str, str, Obj, Any]] = field(default_factory=list)

    def call_api(self, url_path: str, method: str, **kw: Any) -> Any:
        self.calls.append((method, url_path, dict(kw["query_params"]), kw["_request_timeout"]))
        answer = self.answers.pop(0) if self.answers else {}
        if isinstance(answer, ApiException):
            raise answer
        return SimpleNamespace(data=json.dumps(answer).encode())


def send(k: Kube, method: str, url: str) -> Obj:
    return k.request(method, url, None if method == "GET" else {"kind": "Pod"})


def test_token_bucket_gives_its_burst_then_paces_at_qps() -> None:
    bucket = TokenBucket(qps=2.0, burst=3)
    assert [bucket.take(0.0) for _ in range(5)] == [0.0, 0.0, 0.0, 0.5, 1.0]  # waiters queue
    assert bucket.take(1.0) == 0.5  # 1 s brought 2 tokens, both already reserved
    assert bucket.take(0.5) == 1.0  # a clock read before another thread's: no time gained or lost
    # A long idle refills to the burst, not beyond.
    assert [bucket.take(100.0) for _ in range(4)] == [0.0, 0.0, 0.0, 0.5]


def test_token_bucket_without_qps_never_waits() -> None:
    bucket = TokenBucket(qps=0.0, burst=1)
    assert [bucket.take(0.0) for _ in range(100)] == [0.0] * 100


def test_every_request_and_every_retry_takes_a_token_from_one_shared_bucket(
    monkeypatch: pytest.MonkeyPatch, waits: list[float]
) -> None:
    monkeypatch.setattr(kube, "_now", lambda: 100.0)  # the clock stands still: only the bucket paces
    api = FakeApi([{}, {}, refused(429, "0"), {}, {}])
    k = Kube(api, qps=10.0, burst=2)
    k.get(PODS)
    k.get(PODS)
    k.patch(f"{PODS}/p", {})  # one 429 (Retry-After 0), then the retry: two tokens
    k.with_guard(lambda m, p: None).get(PODS)  # a derived client shares the bucket
    assert len(api.calls) == 5
    assert waits == pytest.approx([0.1, 0.0, 0.2, 0.3])  # 0.0: the Retry-After


def test_no_rate_limit_when_qps_is_zero(monkeypatch: pytest.MonkeyPatch, waits: list[float]) -> None:
    monkeypatch.setattr(kube, "_now", lambda: 100.0)
    k = Kube(FakeApi(), qps=0, burst=1)
    for _ in range(50):
        k.get(PODS)
    assert waits == []


@pytest.mark.parametrize(("method", "url"), [("PATCH", f"{PODS}/p"), ("POST", PODS), ("POST", f"{PODS}/p/binding")])
def test_a_429_on_a_write_is_sent_again(waits: list[float], method: str, url: str) -> None:
    api = FakeApi([refused(429), refused(429, "2"), {"kind": "Pod"}])
    assert send(Kube(api), method, url) == {"kind": "Pod"}
    assert [(m, u) for m, u, _, _ in api.calls] == [(method, url)] * 3
    assert waits == [kube.RETRY_WAIT_429, 2.0]  # without Retry-After: 1 s


def test_an_eviction_429_reaches_the_caller_at_once(waits: list[float]) -> None:
    api = FakeApi([refused(429, "1"), {}])
    with pytest.raises(KubeError) as err:
        Kube(api).create(f"{PODS}/x/eviction", {"kind": "Eviction"})
    assert err.value.status == 429
    assert len(api.calls) == 1
    assert waits == []


def test_a_503_on_a_patch_is_raised_at_once(waits: list[float]) -> None:
    api = FakeApi([refused(503, "1", "ServiceUnavailable"), {}])
    with pytest.raises(KubeError) as err:
        Kube(api).patch(f"{PODS}/p", {"metadata": {}})
    assert err.value.status == 503
    assert len(api.calls) == 1
    assert waits == []


def test_the_guard_is_asked_before_every_write_and_every_retry_not_a_read(waits: list[float]) -> None:
    asked: list[tuple[str, str]] = []
    api = FakeApi([{}, {}, refused(429, "0"), {}, {}, {}])
    k = Kube(api).with_guard(lambda method, url: asked.append((method, url)))
    k.get(PODS)
    k.create(PODS, {"metadata": {"name": "p"}})
    k.update(f"{PODS}/p", {})  # a 429, then sent again: asked again
    k.patch(f"{PODS}/p", {})
    k.delete(f"{PODS}/p")
    assert asked == [("POST", PODS)] + [("PUT", f"{PODS}/p")] * 2 + [("PATCH", f"{PODS}/p"), ("DELETE", f"{PODS}/p")]
    assert len(api.calls) == 6
    asked.clear()
    k.unguarded().patch(f"{PODS}/p", {})
    assert asked == []


def test_a_refused_write_reaches_the_caller_and_nothing_is_sent(
    monkeypatch: pytest.MonkeyPatch, waits: list[float]
) -> None:
    monkeypatch.setattr(kube, "_now", lambda: 100.0)

    def guard(method: str, url: str) -> None:
        raise NotLeadingError(method, url, 0, "NotLeading", "the lease is gone")

    api = FakeApi([{}])
    k = Kube(api, qps=1.0, burst=1).with_guard(guard)
    for method in ("POST", "PUT", "PATCH", "DELETE"):
        with pytest.raises(KubeError) as err:  # callers that handle a KubeError handle it
            send(k, method, f"{PODS}/p")
        assert isinstance(err.value, NotLeadingError)
        assert (err.value.status, err.value.reason) == (0, "NotLeading")
    assert api.calls == []
    k.get(PODS)  # the refusals took no token: the burst of 1 is still there
    assert waits == []
    assert len(api.calls) == 1


def test_the_deadline_client_does_not_retry_a_429(waits: list[float]) -> None:
    api = FakeApi([refused(429, "1"), {}])
    base = Kube(api, timeout=15.0).with_guard(lambda m, u: pytest.fail("the Lease's calls are not guarded"))
    deadline = base.for_deadline(2.0)
    with pytest.raises(KubeError) as err:
        deadline.update("/apis/coordination.k8s.io/v1/namespaces/ns/leases/l", {})
    assert err.value.status == 429
    assert [(m, timeout) for m, _, _, timeout in api.calls] == [("PUT", 2.0)]
    assert waits == []
    assert deadline.limiter is not base.limiter  # a renewal never queues behind the writes
    assert [deadline.limiter.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert (base.timeout, base.retry) == (15.0, True)  # the original is unchanged


def test_the_deadline_client_turns_urllib3_retries_off(tmp_path: Path) -> None:
    """A server that hangs up on every connection: the connected client tries 1 + its retries
    times, the deadline client once; both answer a KubeError "Unreachable", not urllib3's own."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[int] = []

    def hang_up() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed: the test is over
                return
            accepted.append(1)
            conn.close()

    threading.Thread(target=hang_up, daemon=True).start()
    try:
        k = Kube.connect(_kubeconfig(tmp_path, listener.getsockname()[1]), retries=2)
        deadline = k.for_deadline(1.0)
        for client, tries in ((k, 3), (deadline, 1)):
            accepted.clear()
            with pytest.raises(KubeError) as err:
                client.get(PODS)
            assert (err.value.status, err.value.reason) == (0, "Unreachable")
            assert len(accepted) == tries
        assert k.config.retries.total == 2  # the connected client keeps its own
        assert deadline.config.api_key is k.config.api_key  # one token, refreshed for both
    finally:
        listener.close()


def page(names: list[str], token: str | None = None) -> Obj:
    return {"kind": "PodList", "metadata": {"continue": token} if token else {}, "items": [{"name": n} for n in names]}


def test_list_all_follows_continue_tokens() -> None:
    api = FakeApi([page(["a", "b"], "t1"), page(["c", "d"], "t2"), page(["e"])])
    items = Kube(api).list_all(PODS, chunk=2, labelSelector="app=x")
    assert [i["name"] for i in items] == ["a", "b", "c", "d", "e"]
    assert [params for _, _, params, _ in api.calls] == [
        {"labelSelector": "app=x", "limit": 2},
        {"labelSelector": "app=x", "limit": 2, "continue": "t1"},
        {"labelSelector": "app=x", "limit": 2, "continue": "t2"},
    ]


def test_list_all_starts_over_once_when_its_token_expired() -> None:
    gone = refused(410, reason="Expired")
    api = FakeApi([page(["a"], "t1"), gone, page(["a2"], "u1"), page(["b2"])])
    assert [i["name"] for i in Kube(api).list_all(PODS, chunk=1)] == ["a2", "b2"]  # one snapshot, no mix
    assert [params.get("continue") for _, _, params, _ in api.calls] == [None, "t1", None, "u1"]

    api = FakeApi([page(["a"], "t1"), gone, page(["a"], "u1"), gone, page(["never"])])
    with pytest.raises(KubeError) as err:
        Kube(api).list_all(PODS, chunk=1)
    assert err.value.status == 410
    assert len(api.calls) == 4


def test_list_all_raises_a_410_on_its_first_page() -> None:
    api = FakeApi([refused(410, reason="Expired"), page(["a"])])
    with pytest.raises(KubeError):
        Kube(api).list_all(PODS, resourceVersion="1", resourceVersionMatch="NotOlderThan")
    assert len(api.calls) == 1


def test_the_api_servers_clock_is_read_from_the_date_of_its_answers(
    api: tuple[Script, str], waits: list[float]
) -> None:
    """The API server's clock runs an hour ahead: its answers' Date says so, refusals' too, and
    the clients derived from one share what it learned."""
    script, kubeconfig = api
    script.skew = 3600.0
    client = Kube.connect(kubeconfig)
    assert client.server_clock.offset() == 0.0, "no answer yet: the wall clock"
    client.get(PODS)
    assert client.server_clock.offset() == pytest.approx(3600, abs=1.5)
    script.skew, script.answers = -60.0, [(403, None)]
    lease_client = client.for_deadline(1.0)
    for _ in range(ServerClock.SAMPLES):  # the median follows once most recent answers say so
        with pytest.raises(KubeError):
            lease_client.get(PODS)
    assert client.server_clock.offset() == pytest.approx(-60, abs=1.5)
    assert client.server_clock.now().timestamp() == pytest.approx(time.time() - 60, abs=1.5)


def test_the_server_clock_ignores_answers_without_a_date() -> None:
    clock = ServerClock(wall=lambda: 1000.0)
    clock.observe(None)
    clock.observe("not a date")
    assert clock.offset() == 0.0
    clock.observe(email.utils.formatdate(1100.0, usegmt=True))
    assert clock.offset() == 100.5, "a Date's whole second, taken at its middle"
