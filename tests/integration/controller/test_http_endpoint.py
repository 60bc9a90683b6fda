"""The controller's HTTP endpoint against hostile clients: real listeners, real sockets.

The input matrix drives a stand-in controller (it records barrier requests), so each case
shows that a bad request never reaches the controller; the last test drives `spotrl run`
while it starts up.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from controller_runs import ROOT, Runs, stop, wait_for

from spotrl_runtime.api.times import Deadline
from spotrl_runtime.controller.control import BarrierFailed, CutInfo
from spotrl_runtime.controller.http import MAX_BODY, ControlServer, Endpoint
from spotrl_runtime.controller.loop import STATS
from spotrl_runtime.core.owners import RecoveryCounters

READ_TIMEOUT = 1.0
EXAMPLE = ROOT / "examples/tiny-cpu.yaml"
CUT = CutInfo("0000000003", 7, "file:///cuts/cuts/0000000003", "barrier", 1.7e9, 0.5)


class StandIn:
    """What the endpoint reads of a controller, and every barrier it was asked for."""

    def __init__(self) -> None:
        self.job = SimpleNamespace(name="tiny")
        self.asked: list[tuple[str, float]] = []
        self.fail: BaseException | None = None
        self.parked = False
        self.target_steps = 16
        self.cuts: list[CutInfo] = []
        self.resumed_from = None
        self.stats = dict.fromkeys(STATS, 0.0)
        self.history: list[dict[str, Any]] = []
        self.parts = SimpleNamespace(pool=SimpleNamespace(workers=lambda: []))
        self.owners = SimpleNamespace(
            attempt=2,
            trainer_step=7,
            dispatch_index=8,
            in_flight=lambda: [],
            counters=RecoveryCounters(),
            census=lambda: {"ledger_admitted": 0},
        )

    def request_barrier(self, reason: str, deadline: Deadline) -> CutInfo:
        self.asked.append((reason, deadline.remaining()))
        if self.fail is not None:
            raise self.fail
        self.parked = True
        return CUT


@pytest.fixture
def endpoint() -> Endpoint:
    return Endpoint("tiny", attempt=2, target_steps=16)


@pytest.fixture
def controller(endpoint: Endpoint) -> StandIn:
    c = StandIn()
    endpoint.serve(c)
    return c


@pytest.fixture
def private(endpoint: Endpoint) -> Iterator[ControlServer]:
    server = ControlServer(endpoint, "127.0.0.1", 0, private=True, read_timeout=READ_TIMEOUT, max_connections=4)
    yield server.start()
    server.stop()


@pytest.fixture
def public(endpoint: Endpoint) -> Iterator[ControlServer]:
    server = ControlServer(endpoint, "127.0.0.1", 0, private=False, read_timeout=READ_TIMEOUT)
    yield server.start()
    server.stop()


def _port(server: ControlServer) -> int:
    return int(server.address.rsplit(":", 1)[1])


def request(server: ControlServer, method: str, path: str, body: bytes | None = None) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", _port(server), timeout=10)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    is_json = resp.getheader("Content-Type") == "application/json"
    return resp.status, json.loads(data) if is_json else data.decode()


def raw(
    server: ControlServer, data: bytes, *, shut_write: bool = False, timeout: float = 10
) -> tuple[int, dict[str, Any]]:
    """Sends ``data`` as it is and reads the answer until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", _port(server)), timeout=timeout) as s:
        s.sendall(data)
        if shut_write:
            s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    answer = b"".join(chunks)
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    return status, json.loads(body)


def barrier(server: ControlServer, body: bytes) -> tuple[int, Any]:
    return request(server, "POST", "/barrier", body)


@pytest.mark.parametrize(
    ("body", "names"),
    [
        (b'{"deadlineSeconds": -5}', "deadlineSeconds: must be a number from 1 to 3600"),
        (b'{"deadlineSeconds": 0}', "deadlineSeconds: must be a number from 1 to 3600"),
        (b'{"deadlineSeconds": 1e308}', "got 1e+308"),
        (b'{"deadlineSeconds": NaN}', "got NaN"),
        (b'{"deadlineSeconds": Infinity}', "got Infinity"),
        (b'{"deadlineSeconds": ' + b"9" * 1000 + b"}", "deadlineSeconds: must be a number"),
        (b'{"deadlineSeconds": "30"}', 'got "30"'),
        (b'{"deadlineSeconds": true}', "got true"),
        (b"null", "body: must be a JSON object such as"),
        (b"[1]", "not an array"),
        (b'"barrier please"', "not a string"),
        (b"30", "not a number"),
        (b"{not json", "body: not JSON"),
        (b"\xff\xfe\x00garbage", "body: not JSON"),
        (b"[" * 2000 + b"]" * 2000, "body: not JSON"),
        (b'{"deadline": 30}', "unknown field(s) deadline: a barrier takes reason and deadlineSeconds"),
        (b'{"reason": 5}', "reason: must be a string of at most 256"),
        (b'{"reason": "' + b"x" * 300 + b'"}', "reason: must be a string of at most 256"),
        (b'{"reason": "two\\nlines"}', "reason: must be a string of at most 256 printable characters"),
    ],
)
def test_a_bad_barrier_body_is_a_400_naming_the_field(
    private: ControlServer, controller: StandIn, body: bytes, names: str
) -> None:
    status, answer = barrier(private, body)
    assert status == 400, answer
    assert names in answer["error"]
    assert controller.asked == []
    assert not controller.parked


def test_a_valid_barrier_commits_and_an_empty_body_takes_the_defaults(
    private: ControlServer, controller: StandIn
) -> None:
    status, answer = barrier(private, b'{"reason": "maintenance", "deadlineSeconds": 12.5}')
    assert (status, answer["cut_id"], answer["kind"]) == (200, CUT.cut_id, "barrier")
    status, _ = barrier(private, b"")
    assert status == 200
    (r1, s1), (r2, s2) = controller.asked
    assert r1 == "maintenance"
    assert 11 < s1 <= 12.5
    assert r2 == "http"
    assert 29 < s2 <= 30


def test_a_barrier_that_fails_is_a_503_and_an_unexpected_error_a_500(
    private: ControlServer, controller: StandIn
) -> None:
    controller.fail = BarrierFailed("barrier cut (http) did not commit: storage is gone")
    assert barrier(private, b"{}") == (503, {"error": "barrier cut (http) did not commit: storage is gone"})
    controller.fail = RuntimeError("a bug")
    assert barrier(private, b"{}") == (500, {"error": "RuntimeError: a bug"})
    # The listener still serves.
    assert request(private, "GET", "/healthz") == (200, "ok\n")


def test_an_oversized_body_is_a_413_unread(private: ControlServer, controller: StandIn) -> None:
    body = b'{"reason": "' + b"x" * MAX_BODY + b'"}'
    status, answer = barrier(private, body)
    assert status == 413
    assert f"at most {MAX_BODY} bytes" in answer["error"]
    # A length it never sends is not waited for.
    head = b"POST /barrier HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n{}"
    status, answer = raw(private, head, shut_write=True)
    assert status == 413
    assert controller.asked == []


def test_a_stalled_body_gets_a_408_and_the_endpoint_keeps_serving(private: ControlServer, controller: StandIn) -> None:
    answers: list[tuple[int, dict[str, Any]]] = []
    head = b"POST /barrier HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
    stalled = threading.Thread(target=lambda: answers.append(raw(private, head)))
    started = time.monotonic()
    stalled.start()
    # While that client sends nothing, others are served.
    assert request(private, "GET", "/status")[0] == 200
    stalled.join(timeout=READ_TIMEOUT + 5)
    assert not stalled.is_alive(), "the stalled request was not answered"
    assert time.monotonic() - started < READ_TIMEOUT + 5
    (status, answer), *_ = answers
    assert status == 408
    assert "did not arrive within 1 s" in answer["error"]
    assert request(private, "GET", "/status")[0] == 200
    assert controller.asked == []


@pytest.mark.parametrize(
    ("head", "code", "says"),
    [
        (b"POST /barrier HTTP/1.1\r\nHost: x\r\n\r\n", 411, "Content-Length required"),
        (b"POST /barrier HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n", 400, "Content-Length: must be"),
        (b"POST /barrier HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400, "Content-Length: must be"),
        (
            b"POST /barrier HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
            400,
            "Content-Length: must be one",
        ),
        (b"POST /barrier HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", 411, "no "),
        (b"POST /barrier HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{}", 400, "the connection ended after 2"),
    ],
)
def test_a_body_of_no_or_a_wrong_length_is_refused(
    private: ControlServer, controller: StandIn, head: bytes, code: int, says: str
) -> None:
    status, answer = raw(private, head, shut_write=True)
    assert status == code, answer
    assert says in answer["error"]
    assert controller.asked == []


def test_too_many_open_requests_get_a_503_at_once(private: ControlServer, controller: StandIn) -> None:
    """The fixture's listener serves 4 requests at once; stalled clients cannot take more."""
    held = [socket.create_connection(("127.0.0.1", _port(private)), timeout=10) for _ in range(4)]
    try:
        for s in held:
            s.sendall(b"POST /barrier HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
        time.sleep(0.2)
        status, answer = raw(private, b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 503
        assert "busy" in answer["error"]
    finally:
        for s in held:
            s.close()
    wait_for(lambda: request(private, "GET", "/status")[0] == 200, READ_TIMEOUT + 5, "a free slot")


def test_status_answers_before_the_controller_exists_and_a_barrier_says_why_not(
    private: ControlServer, endpoint: Endpoint
) -> None:
    assert request(private, "GET", "/status") == (
        200,
        {"phase": "starting", "job": "tiny", "attempt": 2, "target_steps": 16},
    )
    status, answer = barrier(private, b'{"deadlineSeconds": 30}')
    assert status == 503
    assert "the controller is starting" in answer["error"]
    assert "a SIGTERM now ends start-up without a cut" in answer["error"]
    status, metrics = request(private, "GET", "/metrics")
    assert status == 200
    assert "spotrl_step" not in metrics

    c = StandIn()
    endpoint.serve(c)
    status, answer = request(private, "GET", "/status")
    assert status == 200
    assert (answer["phase"], answer["step"], answer["attempt"], answer["parked"]) == ("running", 7, 2, False)
    assert 'spotrl_step{job="tiny"} 7.0' in request(private, "GET", "/metrics")[1]


def test_status_never_fails(private: ControlServer, endpoint: Endpoint) -> None:
    class Broken(StandIn):
        @property
        def parked(self) -> bool:  # type: ignore[override]
            raise AttributeError("'Controller' object has no attribute 'parked'")

        @parked.setter
        def parked(self, value: bool) -> None:
            pass

    endpoint.serve(Broken())
    status, answer = request(private, "GET", "/status")
    assert status == 200
    assert answer["phase"] == "unknown"
    assert answer["job"] == "tiny"
    assert answer["error"].startswith("AttributeError:")


def test_the_public_listener_serves_metrics_only(public: ControlServer, controller: StandIn) -> None:
    status, answer = request(public, "POST", "/barrier", b'{"deadlineSeconds": 30}')
    assert status == 404
    assert "this listener serves GET /metrics and GET /healthz" in answer["error"]
    assert request(public, "GET", "/status")[0] == 404
    assert request(public, "GET", "/healthz") == (200, "ok\n")
    status, metrics = request(public, "GET", "/metrics")
    assert status == 200
    assert 'spotrl_step{job="tiny"} 7.0' in metrics
    assert controller.asked == []
    # Methods it does not know are answered too.
    assert request(public, "DELETE", "/metrics")[0] == 501


@pytest.mark.slow
def test_spotrl_run_serves_while_it_starts_and_ray_listens_apart(runs: Runs, tmp_path: Path) -> None:
    """`--worker-nodes` holds start-up (no worker joins): /status says so, a barrier is refused
    with the reason, the metrics listener has no /barrier, Ray listens at --host while the
    endpoint stays on 127.0.0.1, and SIGTERM ends start-up without a cut."""
    storage = tmp_path / "cuts"
    proc = runs.start(
        runs.job(), storage, "--worker-nodes", "--host", "127.0.77.9", "--http-port", "0", "--metrics-port", "0"
    )
    try:
        wait_for(lambda: "metrics endpoint:" in runs.log_of(proc), 120, "the endpoints", proc)
        log = runs.log_of(proc)
        private = re.search(r"controller endpoint: http://127\.0\.0\.1:(\d+) ", log)
        public = re.search(r"metrics endpoint: http://127\.0\.0\.1:(\d+) ", log)
        assert private, log
        assert public, log
        ports = SimpleNamespace(private=int(private.group(1)), public=int(public.group(1)))

        def get(port: int, method: str, path: str, body: bytes | None = None) -> tuple[int, Any]:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request(method, path, body=body)
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())

        status, answer = get(ports.private, "GET", "/status")
        assert status == 200
        assert (answer["phase"], answer["job"]) == ("starting", "tiny"), answer
        wait_for(lambda: "spotrl worker --address" in runs.log_of(proc), 300, "the Ray head", proc)
        assert re.search(r"spotrl worker --address 127\.0\.77\.9:\d+", runs.log_of(proc))
        assert get(ports.private, "GET", "/status")[1]["phase"] == "starting"
        status, answer = get(ports.private, "POST", "/barrier", b'{"deadlineSeconds": 30}')
        assert status == 503
        assert "the controller is starting" in answer["error"]
        assert get(ports.public, "POST", "/barrier", b'{"deadlineSeconds": 30}')[0] == 404
        assert get(ports.public, "GET", "/status")[0] == 404
        assert stop(proc, signal.SIGTERM) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not (storage / "cuts").exists() or not any((storage / "cuts").iterdir())
    assert "Traceback" not in runs.log_of(proc)


def test_a_port_taken_fails_spotrl_run_before_ray_and_only_warns_in_a_pod(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from spotrl_runtime.commands.preflight import UsageError
    from spotrl_runtime.commands.run import start_listeners

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ray_tmp = tmp_path / "ray"
        ray_tmp.mkdir()
        out = subprocess.run(
            [sys.executable, "-m", "spotrl_runtime.cli", "run", "-f", str(EXAMPLE), "--http-port", str(port)],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env={**os.environ, "SPOTRL_RAY_TMP": str(ray_tmp)},
            timeout=120,
        )
        assert out.returncode == 2, out.stderr
        assert out.stderr.splitlines() == [
            f"spotrl run: --http-host/--http-port 127.0.0.1:{port}: cannot listen there (Address already in use); "
            "pick another port, or 0 for any free one"
        ]
        assert "Traceback" not in out.stderr
        assert not any(ray_tmp.iterdir())
        assert not (tmp_path / "spotrl-runs").exists()

        # `spotrl controller`: the run goes on without that listener, and says so.
        options = SimpleNamespace(http_host="127.0.0.1", http_port=port, metrics_host="127.0.0.1", metrics_port=0)
        with pytest.raises(UsageError):
            start_listeners(Endpoint("tiny"), options)
        servers = start_listeners(Endpoint("tiny"), options, required=False)
        try:
            assert [s.private for s in servers] == [False]
            assert f"127.0.0.1:{port}: cannot listen there (Address already in use); the run goes on without it" in (
                caplog.text
            )
        finally:
            for s in servers:
                s.stop()
