"""spotrl_e2e.kube.wait_crd_served, the one wait of the test fixtures and the benchmarks for a
CRD they just applied: its status comes a moment after the apply, and its storage answers
lists with 429 "storage is (re)initializing" (and a Retry-After) a moment after that.

A scripted client stands in for the API server, and a fake clock makes the waits exact;
the real path runs in every fixture that applies the CRD (tests/cluster/test_crd.py,
tests/e2e/conftest.py) and in bench/bench_operator.py. The last test checks that the real
client reads the Retry-After header into the error the wait goes by.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spotrl_e2e.kube import ApiError, Credentials, KubeClient, retry_after_seconds, wait_crd_served
from spotrl_e2e.pki import ClusterPKI

NAME = "rljobs.spotrl.dev"
CRD_URL = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{NAME}"
LIST_URL = "/apis/spotrl.dev/v1alpha1/rljobs"
Obj = dict[str, Any]


def crd(conditions: list[Obj] | None) -> Obj:
    doc: Obj = {
        "metadata": {"name": NAME},
        "spec": {
            "group": "spotrl.dev",
            "names": {"plural": "rljobs", "kind": "RLJob"},
            "versions": [{"name": "v1alpha1", "served": True, "storage": True}],
        },
    }
    if conditions is not None:
        doc["status"] = {"conditions": conditions}
    return doc


ESTABLISHED = crd([{"type": "NamesAccepted", "status": "True"}, {"type": "Established", "status": "True"}])
NOT_YET = crd(None)  # just applied: no status at all


def too_many(retry_after: float | None, url: str = LIST_URL) -> ApiError:
    status = {"kind": "Status", "code": 429, "reason": "TooManyRequests", "message": "storage is (re)initializing"}
    return ApiError("GET", url, 429, status, retry_after)


class Clock:
    """time.monotonic and time.sleep for the wait: sleeping moves the clock, and is recorded."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.slept.append(round(seconds, 6))
        self.now += seconds


class ScriptedApi:
    """Answers each URL from its script, one entry a call (an ApiError is raised); the last
    entry repeats. The clock advances a little on each call, as a real request takes time."""

    def __init__(self, clock: Clock, crd_answers: list[Any], list_answers: list[Any]):
        self.clock = clock
        self.scripts = {CRD_URL: crd_answers, LIST_URL: list_answers}
        self.calls: list[str] = []

    def _answer(self, url: str) -> Any:
        self.calls.append(url)
        self.clock.now += 0.01
        script = self.scripts[url]
        answer = script.pop(0) if len(script) > 1 else script[0]
        if isinstance(answer, ApiError):
            raise answer
        return answer

    def get_or_none(self, url: str) -> Obj | None:
        return self._answer(url)  # type: ignore[no-any-return]

    def get(self, url: str, **params: Any) -> Obj:
        assert params == {}, "a list with a limit goes to etcd while the cache is not ready: it proves nothing"
        return self._answer(url)  # type: ignore[no-any-return]


def wait(api: ScriptedApi, clock: Clock, timeout: float = 30) -> Obj:
    return wait_crd_served(api, NAME, timeout, clock=clock.clock, sleep=clock.sleep)  # type: ignore[arg-type]


def test_waits_for_the_status_then_for_the_storage_as_its_retry_after_asks() -> None:
    clock = Clock()
    api = ScriptedApi(
        clock,
        crd_answers=[None, NOT_YET, crd([{"type": "NamesAccepted", "status": "True"}]), ESTABLISHED],
        list_answers=[too_many(1), too_many(2), {"items": []}],
    )
    assert wait(api, clock) == ESTABLISHED
    assert api.calls == [CRD_URL] * 4 + [LIST_URL] * 3
    # 0.2 s between polls of the status; then exactly what each 429's Retry-After asked.
    assert clock.slept == [0.2, 0.2, 0.2, 1.0, 2.0]


def test_an_established_crd_whose_storage_answers_at_once_takes_no_wait() -> None:
    clock = Clock()
    api = ScriptedApi(clock, crd_answers=[ESTABLISHED], list_answers=[{"items": []}])
    assert wait(api, clock) == ESTABLISHED
    assert clock.slept == []


def test_a_429_on_the_crd_itself_is_waited_out_too() -> None:
    clock = Clock()
    api = ScriptedApi(clock, crd_answers=[too_many(3, CRD_URL), ESTABLISHED], list_answers=[{"items": []}])
    assert wait(api, clock) == ESTABLISHED
    assert clock.slept == [3.0]


def test_a_crd_never_established_times_out_naming_it_what_was_awaited_and_the_last_status() -> None:
    clock = Clock()
    start = clock.now
    api = ScriptedApi(clock, crd_answers=[crd([{"type": "NamesAccepted", "status": "False"}])], list_answers=[{}])
    with pytest.raises(TimeoutError) as err:
        wait(api, clock, timeout=5)
    message = str(err.value)
    assert f"CRD {NAME} to be Established" in message
    assert '"type": "NamesAccepted", "status": "False"' in message
    assert LIST_URL not in api.calls
    # Bounded: it gave up at the timeout (the last poll's request time aside).
    assert 5 <= clock.now - start <= 5.02
    assert sum(clock.slept) <= 5


def test_a_crd_that_is_not_there_says_so() -> None:
    clock = Clock()
    api = ScriptedApi(clock, crd_answers=[None], list_answers=[{}])
    with pytest.raises(TimeoutError, match=f"CRD {NAME} to be Established; the last answer: the CRD is not there"):
        wait(api, clock, timeout=1)


def test_storage_that_never_initializes_times_out_at_the_deadline_not_after_its_retry_after() -> None:
    clock = Clock()
    start = clock.now
    api = ScriptedApi(clock, crd_answers=[ESTABLISHED], list_answers=[too_many(30)])
    with pytest.raises(TimeoutError) as err:
        wait(api, clock, timeout=10)
    message = str(err.value)
    assert f"CRD {NAME}'s storage to answer a list of {LIST_URL}" in message
    assert "HTTP 429 TooManyRequests: storage is (re)initializing" in message
    # The server asked for 30 s; the wait gives it only what is left of its 10.
    assert clock.slept == [pytest.approx(10 - 0.02)]  # two requests of 0.01 s before it
    assert clock.now - start <= 10.03


@pytest.mark.alone
def test_the_real_clock_is_bounded_too() -> None:
    api = ScriptedApi(Clock(), crd_answers=[NOT_YET], list_answers=[{}])
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="to be Established"):
        wait_crd_served(api, NAME, 0.5)  # type: ignore[arg-type]
    assert time.monotonic() - start < 2


@pytest.mark.parametrize(
    "refusal",
    [
        too_many(None),  # no Retry-After: the server did not say "later"
        ApiError("GET", LIST_URL, 403, {"reason": "Forbidden", "message": "no"}),
        ApiError("GET", LIST_URL, 404, {"reason": "NotFound", "message": "the server could not find it"}),
    ],
)
def test_any_other_refusal_is_raised_at_once(refusal: ApiError) -> None:
    clock = Clock()
    api = ScriptedApi(clock, crd_answers=[ESTABLISHED], list_answers=[refusal, {"items": []}])
    with pytest.raises(ApiError) as err:
        wait(api, clock)
    assert err.value is refusal
    assert clock.slept == []


def test_retry_after_header() -> None:
    assert retry_after_seconds("1") == 1.0
    assert retry_after_seconds("2.5") == 2.5
    assert retry_after_seconds(None) is None
    assert retry_after_seconds("") is None
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") is None  # the date form: not the API server's


@pytest.fixture
def too_many_server() -> Iterator[str]:
    """An HTTP server on the loopback that answers every GET as a not-ready watch cache does."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(too_many(None).body).encode()
            self.send_response(429)
            self.send_header("Retry-After", "3")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_client_reads_retry_after_into_its_error(too_many_server: str, tmp_path: Path) -> None:
    client = KubeClient(Credentials(server=too_many_server, ca=ClusterPKI(tmp_path / "pki").ca.cert))
    with pytest.raises(ApiError) as err:
        client.get(LIST_URL)
    assert (err.value.status, err.value.reason, err.value.retry_after) == (429, "TooManyRequests", 3.0)
    assert "storage is (re)initializing" in str(err.value)
