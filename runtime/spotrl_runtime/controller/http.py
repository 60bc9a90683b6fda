"""The controller's HTTP endpoint: Prometheus metrics, status, and barrier requests.

Two kinds of listener serve one :class:`Endpoint`:

- **public** (``private=False``): ``GET /metrics`` (Prometheus text format, see
  :mod:`spotrl_runtime.controller.metrics`) and ``GET /healthz``, nothing else. In a pod it
  listens on the pod's IP, for Prometheus.
- **private** (``private=True``): the same, plus ``GET /status`` (JSON: phase, step, attempt,
  owners, last cut, counters) and ``POST /barrier`` with ``{"reason": "...",
  "deadlineSeconds": 30}``, which takes a barrier cut and answers with the committed cut (200)
  or why there is none (503); after it the controller is parked until it is stopped, as after
  any barrier. It listens on loopback unless told otherwise: in a pod,
  ``kubectl port-forward pod/<pod> 8080`` reaches it.

The listeners start before the controller exists (restoring a cut and starting Ray take a
while): ``/status`` then answers ``{"phase": "starting", ...}`` and ``POST /barrier`` 503.

Every request gets an answer: a body that is not what the route takes is a 400 naming the
field and what is allowed (or 411, 413), a client that stops sending gets 408 after
``read_timeout`` seconds, and anything unexpected is a 500 with the error's type. At most
``MAX_CONNECTIONS`` requests are served at once; more get 503 at once.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import threading
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from spotrl_runtime.api.times import Deadline
from spotrl_runtime.controller.control import BarrierFailed, CutInfo
from spotrl_runtime.core.cut_estimate import CutEstimate

log = logging.getLogger("spotrl.http")

MAX_BODY = 4096
"""Bytes a request body may have (a barrier request is a few dozen)."""
READ_TIMEOUT = 10.0
"""Seconds a client may take to send each part of its request before it gets 408."""
MAX_CONNECTIONS = 32
"""Requests served at once; a barrier request holds its connection until the cut commits."""
DEADLINE_SECONDS = 30.0
DEADLINE_MIN, DEADLINE_MAX = 1.0, 3600.0
REASON_MAX = 256
STARTING = (
    "the controller is starting (restoring its cut, starting generation); there is nothing to cut yet: "
    "a SIGTERM now ends start-up without a cut. Ask again once /status says phase 'running'"
)
PUBLIC_ROUTES = "GET /metrics and GET /healthz"
PRIVATE_ROUTES = "GET /metrics, GET /healthz, GET /status and POST /barrier"


class Refused(Exception):  # noqa: N818 - an answer, not a failure of the server
    """A request the endpoint answers with ``code`` and ``message`` (4xx, 503)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class BarrierAsk:
    """A valid ``POST /barrier`` body."""

    reason: str = "http"
    deadline_seconds: float = DEADLINE_SECONDS


def parse_barrier(body: bytes) -> BarrierAsk:
    """The barrier a request body asks for; an empty body takes the defaults. Raises
    :class:`Refused` (400) naming the field and what it may be."""
    if not body.strip():
        return BarrierAsk()
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as err:
        raise Refused(
            400, f'body: not JSON ({err}); send e.g. {{"reason": "maintenance", "deadlineSeconds": 30}}'
        ) from None
    if not isinstance(doc, dict):
        raise Refused(400, f'body: must be a JSON object such as {{"deadlineSeconds": 30}}, not {_json_type(doc)}')
    unknown = sorted(set(doc) - {"reason", "deadlineSeconds"})
    if unknown:
        raise Refused(400, f"unknown field(s) {', '.join(unknown)}: a barrier takes reason and deadlineSeconds")
    seconds = doc.get("deadlineSeconds", DEADLINE_SECONDS)
    number = isinstance(seconds, int | float) and not isinstance(seconds, bool)
    # Compared before any float conversion (a huge integer would overflow it); NaN compares False.
    if not (number and DEADLINE_MIN <= seconds <= DEADLINE_MAX):
        got = json.dumps(seconds)
        raise Refused(
            400,
            f"deadlineSeconds: must be a number from {DEADLINE_MIN:g} to {DEADLINE_MAX:g} (seconds the cut may "
            f"take), got {got if len(got) <= 40 else got[:37] + '...'}",
        )
    reason = doc.get("reason", "http")
    if not isinstance(reason, str) or len(reason) > REASON_MAX or not reason.isprintable():
        raise Refused(400, f"reason: must be a string of at most {REASON_MAX} printable characters")
    return BarrierAsk(reason or "http", float(seconds))


class Endpoint:
    """What the listeners serve: the controller once it is built (:meth:`serve`), and before
    that what is known of the job. Thread-safe."""

    def __init__(self, job: str, attempt: int | None = None, target_steps: int | None = None):
        self.job = job
        self.attempt = attempt
        self.target_steps = target_steps
        self._lock = threading.Lock()
        self._controller: Any = None
        self._registry: Any = None

    def serve(self, controller: Any) -> None:
        """From now on the listeners answer for ``controller``."""
        from spotrl_runtime.controller.metrics import registry_for

        registry = registry_for(controller)
        with self._lock:
            self._controller, self._registry = controller, registry

    def _current(self) -> tuple[Any, Any]:
        with self._lock:
            return self._controller, self._registry

    def metrics(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        _, registry = self._current()
        return (generate_latest(registry) if registry is not None else b""), CONTENT_TYPE_LATEST

    def status(self) -> dict[str, Any]:
        """Never raises: what is known, and what could not be read."""
        controller, _ = self._current()
        starting = {"phase": "starting", "job": self.job, "attempt": self.attempt, "target_steps": self.target_steps}
        if controller is None:
            return starting
        try:
            return status_of(controller)
        except Exception as err:  # a status read must not take the endpoint down
            log.exception("/status")
            return {**starting, "phase": "unknown", "error": f"{type(err).__name__}: {err}"}

    def barrier(self, ask: BarrierAsk) -> dict[str, Any]:
        controller, _ = self._current()
        if controller is None:
            raise Refused(503, STARTING)
        try:
            cut = controller.request_barrier(ask.reason, Deadline.after(ask.deadline_seconds))
        except BarrierFailed as err:
            raise Refused(503, str(err)) from None
        return cut_doc(cut)


def status_of(controller: Any) -> dict[str, Any]:
    """What /status shows once the controller is built: where the run is and who owns what."""
    owners = controller.owners
    parked = controller.parked
    return {
        "phase": "parked" if parked else "running",
        "job": controller.job.name,
        "attempt": owners.attempt,
        "step": owners.trainer_step,
        "target_steps": controller.target_steps,
        "dispatch_index": owners.dispatch_index,
        "parked": parked,
        "in_flight": len(owners.in_flight()),
        "last_cut": cut_doc(controller.cuts[-1]) if controller.cuts else None,
        "resumed_from": cut_doc(controller.resumed_from) if controller.resumed_from else None,
        "cut_estimate": _estimate_doc(controller.cuts[-1].estimate) if controller.cuts else None,
        "counters": dict(owners.counters.__dict__),
        "stats": dict(controller.stats),
        "generation_workers": controller.parts.pool.workers(),
    }


def cut_doc(cut: CutInfo) -> dict[str, Any]:
    """A committed cut as JSON: its fields, the estimate after it as an object."""
    return {**cut.__dict__, "timings": dict(cut.timings), "estimate": _estimate_doc(cut.estimate)}


def _estimate_doc(estimate: CutEstimate | None) -> dict[str, Any] | None:
    """A barrier cut's estimated seconds (:mod:`spotrl_runtime.core.cut_estimate`) as JSON."""
    return asdict(estimate) if estimate is not None else None


class ControlServer:
    """One listener on ``host:port`` (port 0: any free port) serving ``endpoint`` in daemon
    threads; ``private`` adds /status and POST /barrier. Raises OSError if it cannot listen."""

    def __init__(
        self,
        endpoint: Endpoint,
        host: str,
        port: int,
        *,
        private: bool,
        read_timeout: float = READ_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
    ):
        self.endpoint = endpoint
        self.private = private
        self._httpd = _Server((host, port), _handler(endpoint, private, read_timeout), max_connections)
        shown = f"[{host}]" if ":" in host else host
        self.address = f"http://{shown}:{self._httpd.server_address[1]}"
        self.routes = PRIVATE_ROUTES if private else PUBLIC_ROUTES
        # A short poll: stop() waits for it, and after a SIGTERM the grace period is running.
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), name="http", daemon=True)

    def start(self) -> ControlServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_connections: int):
        self.address_family = _family(address[0])
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            _answer_busy(request)
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def _family(host: str) -> socket.AddressFamily:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return socket.AF_INET


def _answer_busy(request: socket.socket) -> None:
    body = json.dumps({"error": "busy: as many requests as this listener serves at once are open; try again"}).encode()
    head = f"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    try:
        request.settimeout(1.0)
        request.sendall(head.encode() + body)
    except OSError:
        pass


def _handler(endpoint: Endpoint, private: bool, read_timeout: float) -> type[BaseHTTPRequestHandler]:
    routes = PRIVATE_ROUTES if private else PUBLIC_ROUTES

    class Handler(BaseHTTPRequestHandler):
        timeout = read_timeout  # every read of the request: the request line, headers, body

        def log_message(self, format: str, *args: Any) -> None:  # quiet: the controller logs what matters
            return

        def do_GET(self) -> None:
            self._answer(self._get)

        def do_POST(self) -> None:
            self._answer(self._post)

        def _get(self) -> tuple[int, bytes, str]:
            if self.path == "/metrics":
                body, ctype = endpoint.metrics()
                return 200, body, ctype
            if self.path == "/healthz":
                return 200, b"ok\n", "text/plain; charset=utf-8"
            if self.path == "/status" and private:
                return 200, _json(endpoint.status()), "application/json"
            raise Refused(404, f"not found: {self.path}; this listener serves {routes}")

        def _post(self) -> tuple[int, bytes, str]:
            if self.path != "/barrier" or not private:
                raise Refused(404, f"not found: POST {self.path}; this listener serves {routes}")
            ask = parse_barrier(self._body())
            return 200, _json(endpoint.barrier(ask)), "application/json"

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding"):
                raise Refused(411, "send the body with a Content-Length (no Transfer-Encoding)")
            lengths = self.headers.get_all("Content-Length") or []
            if not lengths:
                raise Refused(411, "Content-Length required (e.g. curl -d '{\"deadlineSeconds\": 30}')")
            if len(set(lengths)) != 1 or not (lengths[0].isascii() and lengths[0].strip().isdigit()):
                raise Refused(400, f"Content-Length: must be one non-negative integer, got {', '.join(lengths)}")
            length = int(lengths[0])
            if length > MAX_BODY:
                self._discard(length)
                raise Refused(413, f"body: at most {MAX_BODY} bytes, got {length}")
            body = self.rfile.read(length)
            if len(body) < length:
                raise Refused(400, f"body: Content-Length says {length} bytes, the connection ended after {len(body)}")
            return body

        def _discard(self, length: int) -> None:
            """Reads some of a body it refuses, so that closing the connection does not reset it
            before the client reads the answer."""
            left = min(length, 16 * MAX_BODY)
            try:
                while left > 0 and (chunk := self.rfile.read1(min(left, 65536))):
                    left -= len(chunk)
            except OSError:
                pass

        def _answer(self, route: Any) -> None:
            try:
                code, body, ctype = route()
            except Refused as r:
                code, body, ctype = r.code, _json({"error": r.message}), "application/json"
            except TimeoutError:
                code, ctype = 408, "application/json"
                body = _json({"error": f"request timeout: the body did not arrive within {read_timeout:g} s"})
            except Exception as err:
                log.exception("%s %s", self.command, self.path)
                code, body, ctype = 500, _json({"error": f"{type(err).__name__}: {err}"}), "application/json"
            self.close_connection = True
            try:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)
            except OSError:
                pass  # the client went away; nothing to answer

    return Handler


_JSON_TYPES = {
    dict: "an object",
    list: "an array",
    str: "a string",
    bool: "a boolean",
    int: "a number",
    float: "a number",
}


def _json_type(value: Any) -> str:
    return "null" if value is None else _JSON_TYPES.get(type(value), type(value).__name__)


def _json(doc: Any) -> bytes:
    return json.dumps(doc, default=str).encode()
