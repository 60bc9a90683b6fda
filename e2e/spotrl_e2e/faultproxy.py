"""A fault-injecting HTTP proxy for tests: it sits between an S3 client and a real S3 server
and fails chosen requests the ways a flaky object store and network do.

It speaks just enough HTTP/1.1 to be exact: it reads each request (headers, then a body
framed by ``Content-Length`` or ``Transfer-Encoding: chunked``, answering ``Expect:
100-continue`` itself), forwards it on the client connection's own upstream connection
(keep-alive on both sides), reads the whole answer (``Content-Length``, chunked, or until
the server closes) and relays it byte for byte. Faults, chosen per request by
:class:`Rule` (method, key substring, probability, how many times) with a seeded RNG:

``503``            answers 503 ``SlowDown`` itself (the request never reaches the server)
``500``            answers 500 ``InternalError`` itself
``429``            answers 429 ``TooManyRequests`` itself
``reset_request``  reads the headers and half the body, then resets the connection (RST)
``reset_before``   reads the request, then resets without forwarding it
``lost_answer``    forwards the request (the server acts on it), then resets instead of answering
``reset_body``     forwards, sends the answer's headers and half its body, then resets
``reset_after``    forwards and answers in full, then resets the (keep-alive) connection
``stall``          holds the request ``seconds`` before forwarding it (None: until the proxy closes)
``stall_answer``   forwards, then holds the answer ``seconds`` (None: until the proxy closes)

Apart from faults, :meth:`FaultProxy.strip_header` removes a header from matching requests
before they go on (a server, or a gateway in front of one, that ignores ``If-None-Match``),
and signs each such request again so the server still takes it: SigV4 signs the header.

:attr:`FaultProxy.requests` counts the requests seen, :attr:`FaultProxy.faults` the faults
injected by kind, :attr:`FaultProxy.log` has one ``(method, path, fault)`` per request.
:meth:`FaultProxy.close` ends every connection and joins every thread it started.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import random
import socket
import struct
from collections import Counter
from dataclasses import dataclass
from typing import Literal, get_args
from urllib.parse import unquote, urlsplit

from spotrl_e2e.loopback import ClosedError, Conn, LoopbackServer, header, render

FaultKind = Literal[
    "503",
    "500",
    "429",
    "reset_request",
    "reset_before",
    "lost_answer",
    "reset_body",
    "reset_after",
    "stall",
    "stall_answer",
]
FAULT_KINDS: tuple[FaultKind, ...] = get_args(FaultKind)


@dataclass
class Rule:
    """Injects ``kind`` into requests that match ``method`` (None: any) and whose decoded
    target (path and query) contains ``key`` (None: any), with ``probability``, at most ``times`` times (None:
    no limit). ``seconds``: how long a stall holds (None: until the proxy closes)."""

    kind: FaultKind
    method: str | None = None
    key: str | None = None
    probability: float = 1.0
    times: int | None = None
    seconds: float | None = None
    fired: int = 0

    def matches(self, method: str, path: str) -> bool:
        if self.times is not None and self.fired >= self.times:
            return False
        if self.method is not None and method != self.method:
            return False
        return self.key is None or self.key in path


@dataclass
class Strip:
    """Removes header ``name`` from requests that match ``method`` (None: any) and whose decoded
    target contains ``key`` (None: any), and signs them again with ``secret_key`` (SigV4, the
    request's own credential scope, date and payload hash). ``stripped`` counts the requests."""

    name: str
    secret_key: str
    method: str | None = None
    key: str | None = None
    stripped: int = 0

    def matches(self, method: str, path: str, headers: list[tuple[str, str]]) -> bool:
        if self.method is not None and method != self.method:
            return False
        return (self.key is None or self.key in path) and header(headers, self.name.lower()) is not None


MIX: dict[FaultKind, float] = {
    "503": 0.07,
    "500": 0.06,
    "reset_request": 0.05,
    "reset_before": 0.05,
    "lost_answer": 0.06,
    "reset_body": 0.07,
    "reset_after": 0.05,
    "stall": 0.03,
    "stall_answer": 0.03,
}
"""A heavy mix: about 40 % of all requests fail (1 - the product of the misses)."""

_ANSWERED = ("503", "500", "429")
"""Kinds the proxy answers itself; the request never reaches the server."""


def _error(kind: str, close: bool = False) -> bytes:
    status, code, reason = {
        "500": (500, "InternalError", "Internal Server Error"),
        "503": (503, "SlowDown", "Service Unavailable"),
        "429": (429, "TooManyRequests", "Too Many Requests"),
    }[kind]
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
        f"<Message>injected by the test proxy</Message></Error>"
    ).encode()
    connection = "Connection: close\r\n" if close else ""
    head = f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
    return (head + connection + "\r\n").encode() + body


def _resign(method: str, target: str, headers: list[tuple[str, str]], secret_key: str) -> list[tuple[str, str]]:
    """``headers`` with the SigV4 ``Authorization`` computed again over the headers it signed
    that are still there; a request signed otherwise (or not at all) is left as it is."""
    auth = header(headers, "authorization") or ""
    scheme = "AWS4-HMAC-SHA256 "
    if not auth.startswith(scheme):
        return headers
    fields = dict(part.strip().partition("=")[::2] for part in auth[len(scheme) :].split(","))
    present = {k.lower() for k, _ in headers}
    signed = [h for h in fields["SignedHeaders"].split(";") if h in present]
    path, _, query = target.partition("?")
    pairs = sorted(tuple(p.partition("=")[::2]) for p in query.split("&")) if query else []
    canonical = "\n".join(
        [
            method,
            path,
            "&".join(f"{k}={v}" for k, v in pairs),
            "".join(f"{h}:{','.join(' '.join(v.split()) for k, v in headers if k.lower() == h)}\n" for h in signed),
            ";".join(signed),
            header(headers, "x-amz-content-sha256") or "UNSIGNED-PAYLOAD",
        ]
    )
    scope = fields["Credential"].split("/", 1)[1]
    digest = hashlib.sha256(canonical.encode()).hexdigest()
    to_sign = "\n".join(["AWS4-HMAC-SHA256", header(headers, "x-amz-date") or "", scope, digest])
    key = f"AWS4{secret_key}".encode()
    for part in scope.split("/"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    value = f"{scheme}Credential={fields['Credential']}, SignedHeaders={';'.join(signed)}, Signature={signature}"
    return [(k, value if k.lower() == "authorization" else v) for k, v in headers]


def _reset(sock: socket.socket) -> None:
    """Closes with RST (not FIN): the peer sees 'connection reset'."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


SEED_VAR = "SPOTRL_FAULT_SEED"


def fault_seed() -> int:
    """A test's seed for the proxy's RNG: ``SPOTRL_FAULT_SEED`` replays a failed run's faults;
    else a fresh one each run (printed, so a failure's captured output names it), so that runs
    go through other orders of faults than one fixed seed's."""
    seed = int(os.environ.get(SEED_VAR) or random.SystemRandom().randrange(1 << 30))
    print(f"{SEED_VAR}={seed}")
    return seed


class FaultProxy(LoopbackServer):
    """The proxy, listening on a loopback port in front of ``upstream`` (``http://host:port``)."""

    name = "faultproxy"

    def __init__(self, upstream: str, *, seed: int = 0):
        parsed = urlsplit(upstream)
        self.upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self.rules: list[Rule] = []
        self.strips: list[Strip] = []
        self.requests = 0
        self.faults: Counter[str] = Counter()
        self.log: list[tuple[str, str, str | None]] = []
        self._rng = random.Random(seed)
        super().__init__()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._start()

    # ------------------------------------------------------------ rules

    def add(
        self,
        kind: FaultKind,
        *,
        method: str | None = None,
        key: str | None = None,
        probability: float = 1.0,
        times: int | None = None,
        seconds: float | None = None,
    ) -> Rule:
        """Adds a :class:`Rule`; rules are tried in the order they were added."""
        rule = Rule(kind, method, key, probability, times, seconds)
        with self._lock:
            self.rules.append(rule)
        return rule

    def add_mix(self, stall: float = 0.05) -> None:
        """Every kind of fault at once, at :data:`MIX`'s rates (stalls hold ``stall`` s)."""
        for kind, probability in MIX.items():
            self.add(kind, probability=probability, seconds=stall)

    def strip_header(self, name: str, *, secret_key: str, method: str | None = None, key: str | None = None) -> Strip:
        """Removes header ``name`` from every matching request from now on, signing it again with
        ``secret_key`` (the S3 server's secret key, which a real gateway would not need: it is
        only that the server checks the signature of what arrives)."""
        strip = Strip(name, secret_key, method, key)
        with self._lock:
            self.strips.append(strip)
        return strip

    def clear(self) -> None:
        """Removes every rule and every header strip (the counters stay)."""
        with self._lock:
            self.rules.clear()
            self.strips.clear()

    def _choose(self, method: str, path: str) -> Rule | None:
        with self._lock:
            self.requests += 1
            chosen = None
            for rule in self.rules:
                if rule.matches(method, path) and (rule.probability >= 1 or self._rng.random() < rule.probability):
                    rule.fired += 1
                    self.faults[rule.kind] += 1
                    chosen = rule
                    break
            self.log.append((method, path, chosen.kind if chosen else None))
            return chosen

    # ------------------------------------------------------------ serving

    def _stripped(self, method: str, target: str, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """``headers`` less those a :class:`Strip` removes, signed again."""
        path = unquote(target)
        with self._lock:
            strips = [s for s in self.strips if s.matches(method, path, headers)]
            for strip in strips:
                strip.stripped += 1
        for strip in strips:
            headers = [(k, v) for k, v in headers if k.lower() != strip.name.lower()]
            headers = _resign(method, target, headers, strip.secret_key)
        return headers

    def _serve(self, client_sock: socket.socket) -> None:
        client = Conn(client_sock)
        upstream: Conn | None = None
        try:
            while not self._closing.is_set():
                start, headers = client.head()
                method, target, _ = start.decode("latin-1").split(" ", 2)
                rule = self._choose(method, unquote(target))
                kind = rule.kind if rule else None
                if header(headers, "expect") == "100-continue":
                    headers = [(k, v) for k, v in headers if k.lower() != "expect"]
                    if kind in _ANSWERED:
                        # As a server does: refuse at once, without the body, and close.
                        client_sock.sendall(_error(kind, close=True))
                        return
                    client_sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                if kind == "reset_request":
                    length = int(header(headers, "content-length") or 0)
                    client.exact(length // 2)
                    _reset(client_sock)
                    return
                body = self._body(client, headers)
                headers = self._stripped(method, target, headers)
                if kind in _ANSWERED:
                    client_sock.sendall(_error(kind))
                    continue
                if kind == "reset_before":
                    _reset(client_sock)
                    return
                if kind == "stall" and rule is not None and self._stall(rule.seconds):
                    return
                upstream = upstream or self._connect()
                try:
                    answer = self._forward(upstream, method, start, headers, body)
                except (ClosedError, OSError):
                    # A kept-alive upstream connection the server closed: once more on a new one.
                    self._drop(upstream)
                    upstream = self._connect()
                    answer = self._forward(upstream, method, start, headers, body)
                data, upstream_closes = answer
                if upstream_closes:
                    self._drop(upstream)
                    upstream = None
                if kind == "lost_answer":
                    _reset(client_sock)
                    return
                if kind == "reset_body":
                    head_end = data.index(b"\r\n\r\n") + 4
                    body_len = len(data) - head_end
                    # Half the body; an answer without a body is cut in its headers instead.
                    client_sock.sendall(data[: head_end + body_len // 2] if body_len else data[: head_end // 2])
                    _reset(client_sock)
                    return
                if kind == "stall_answer" and rule is not None and self._stall(rule.seconds):
                    return
                client_sock.sendall(data)
                if kind == "reset_after":
                    _reset(client_sock)
                    return
                if (header(headers, "connection") or "").lower() == "close" or upstream_closes:
                    return
        except (ClosedError, OSError, ValueError):
            return
        finally:
            self._untrack(client_sock)
            with contextlib.suppress(OSError):
                client_sock.close()
            if upstream is not None:
                self._drop(upstream)

    def _stall(self, seconds: float | None) -> bool:
        """Holds ``seconds`` (None: until the proxy closes); True when the proxy is closing."""
        return self._closing.wait(seconds) or seconds is None

    def _body(self, conn: Conn, headers: list[tuple[str, str]]) -> bytes:
        if (header(headers, "transfer-encoding") or "").lower() == "chunked":
            return conn.chunked()
        return conn.exact(int(header(headers, "content-length") or 0))

    def _connect(self) -> Conn:
        sock = socket.create_connection(self.upstream, timeout=60)
        if not self._track(sock):
            sock.close()
            raise ClosedError
        return Conn(sock)

    def _drop(self, conn: Conn) -> None:
        self._untrack(conn.sock)
        with contextlib.suppress(OSError):
            conn.sock.close()

    def _forward(
        self, upstream: Conn, method: str, start: bytes, headers: list[tuple[str, str]], body: bytes
    ) -> tuple[bytes, bool]:
        """Sends the request upstream; the raw answer and whether the server closes after it."""
        upstream.sock.sendall(render(start, headers) + body)
        while True:
            status_line, resp_headers = upstream.head()
            status = int(status_line.split()[1])
            if 100 <= status < 200:
                continue  # interim answers are the proxy's business, not the client's
            break
        closes = (header(resp_headers, "connection") or "").lower() == "close"
        if method == "HEAD" or status in (204, 304):
            resp_body = b""
        elif (header(resp_headers, "transfer-encoding") or "").lower() == "chunked":
            resp_body = upstream.chunked()
        elif (length := header(resp_headers, "content-length")) is not None:
            resp_body = upstream.exact(int(length))
        else:
            resp_body = upstream.until_close()
            closes = True
        return render(status_line, resp_headers) + resp_body, closes

    def summary(self) -> dict[str, object]:
        """The counters, for reports: requests seen and faults by kind."""
        with self._lock:
            return {"requests": self.requests, "faults": dict(sorted(self.faults.items()))}
