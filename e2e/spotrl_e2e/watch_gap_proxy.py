"""A TLS proxy in front of the test API server that opens a watch gap on command: what a client
sees when its watch breaks and the resourceVersion it resumes from has expired (410 Gone).

It terminates TLS with a serving certificate of the cluster's CA (a kubeconfig that trusts the
cluster trusts it), forwards each request as it came (its ``Authorization`` header included)
on the client connection's own TLS connection to the API server, and relays each answer as it
arrives: a watch is one long chunked answer. It speaks just enough HTTP/1.1 for the API
server's clients (the request and answer framing of :mod:`spotrl_e2e.faultproxy`).

:meth:`WatchGapProxy.open_gap` opens a gap on its collections (``/api/v1/pods`` by default,
as a cluster-wide client watches it): their watches in flight are cut, and every new watch of
them is answered as the API server answers a watch from a resourceVersion it no longer has (one
``ERROR`` event, a 410 ``Expired`` Status), until :meth:`WatchGapProxy.close_gap`. Their LISTs go
through. A client such as Kopf then lists again and watches from the new list, so it never
hears of an object deleted in the gap. :attr:`WatchGapProxy.lists` counts each collection's
LISTs, :attr:`WatchGapProxy.gone` the watches answered 410, :attr:`WatchGapProxy.cut` the
watches cut. :meth:`WatchGapProxy.close` ends every connection and joins every thread.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
from collections import Counter
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from spotrl_e2e.loopback import ClosedError, Conn, LoopbackServer, header, render
from spotrl_e2e.pki import KeyPair

EXPIRED = {
    "kind": "Status",
    "apiVersion": "v1",
    "metadata": {},
    "status": "Failure",
    "message": "too old resource version (a watch gap made by the test proxy)",
    "reason": "Expired",
    "code": 410,
}


def _gone_answer() -> bytes:
    """The API server's answer to a watch from an expired resourceVersion: 200, one ERROR event, end."""
    line = json.dumps({"type": "ERROR", "object": EXPIRED}).encode() + b"\n"
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    return head + f"{len(line):x}\r\n".encode() + line + b"\r\n0\r\n\r\n"


def _cut(sock: socket.socket) -> None:
    """Ends the connection under whichever thread reads or writes it (TLS or not)."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


class WatchGapProxy(LoopbackServer):
    """Listens on 127.0.0.1 (:attr:`server`) in front of ``upstream`` (the API server's URL);
    ``ca``: the cluster's CA certificate, ``serving``: a certificate it signed for 127.0.0.1;
    ``collections``: the paths whose watches a gap breaks."""

    name = "watchgap"

    def __init__(
        self, upstream: str, ca: Path, serving: KeyPair, collections: tuple[str, ...] = ("/api/v1/pods",)
    ) -> None:
        parsed = urlsplit(upstream)
        self.upstream = (parsed.hostname or "127.0.0.1", parsed.port or 443)
        self.collections = collections
        self.lists: Counter[str] = Counter()
        self.gone = 0
        self.cut = 0
        self._gap = False
        self._watches: set[tuple[socket.socket, socket.socket]] = set()
        self._to_server = ssl.create_default_context(cafile=str(ca))
        self._to_server.set_alpn_protocols(["http/1.1"])
        self._to_client = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._to_client.load_cert_chain(str(serving.cert), str(serving.key))
        super().__init__()
        self.server = f"https://127.0.0.1:{self.port}"
        self._start()

    # ------------------------------------------------------------ the gap

    def open_gap(self) -> None:
        """Cuts the collections' watches in flight; new ones are answered 410 until :meth:`close_gap`."""
        with self._lock:
            self._gap = True
            watches, self._watches = self._watches, set()
            self.cut += len(watches)
        for pair in watches:
            for sock in pair:
                _cut(sock)

    def close_gap(self) -> None:
        with self._lock:
            self._gap = False

    def _classify(self, method: str, target: str) -> str | None:
        """ "watch" or "list" for a GET of a collection (counted), else None."""
        url = urlsplit(target)
        if method != "GET" or url.path not in self.collections:
            return None
        watch = parse_qs(url.query).get("watch", [""])[0].lower() in ("true", "1")
        with self._lock:
            if not watch:
                self.lists[url.path] += 1
        return "watch" if watch else "list"

    # ------------------------------------------------------------ serving

    def _serve(self, raw: socket.socket) -> None:
        client_sock: socket.socket = raw
        upstream: Conn | None = None
        try:
            client_sock = self._to_client.wrap_socket(raw, server_side=True)
            self._track(client_sock)
            client = Conn(client_sock)
            while not self._closing.is_set():
                start, headers = client.head()
                method, target, _ = start.decode("latin-1").split(" ", 2)
                if (header(headers, "transfer-encoding") or "").lower() == "chunked":
                    body = client.chunked()
                else:
                    body = client.exact(int(header(headers, "content-length") or 0))
                kind = self._classify(method, target)
                upstream = upstream or self._connect()
                if kind == "watch" and not self._start_watch(client_sock, upstream.sock):
                    client_sock.sendall(_gone_answer())
                    continue
                try:
                    try:
                        answer = self._ask(upstream, start, headers, body)
                    except (ClosedError, OSError):
                        if kind == "watch":
                            raise  # cut by a gap: never sent again
                        # A kept-alive connection the server closed meanwhile: once more on a new one.
                        self._untrack(upstream.sock, close=True)
                        upstream = self._connect()
                        answer = self._ask(upstream, start, headers, body)
                    closes = self._relay(upstream, client_sock, method, *answer)
                finally:
                    with self._lock:
                        self._watches.discard((client_sock, upstream.sock))
                if closes or (header(headers, "connection") or "").lower() == "close":
                    return
        except (ClosedError, OSError, ValueError):
            return
        finally:
            self._untrack(raw, client_sock, *((upstream.sock,) if upstream else ()), close=True)

    def _start_watch(self, client: socket.socket, upstream: socket.socket) -> bool:
        """Registers a watch to cut at the next gap; False (and counted) when a gap is open."""
        with self._lock:
            if self._gap:
                self.gone += 1
                return False
            self._watches.add((client, upstream))
            return True

    def _connect(self) -> Conn:
        raw = socket.create_connection(self.upstream, timeout=60)
        sock = self._to_server.wrap_socket(raw, server_hostname=self.upstream[0])
        sock.settimeout(None)  # a watch waits as long as the server keeps it open
        if not self._track(sock):
            sock.close()
            raise ClosedError
        return Conn(sock)

    @staticmethod
    def _ask(
        upstream: Conn, start: bytes, headers: list[tuple[str, str]], body: bytes
    ) -> tuple[bytes, list[tuple[str, str]]]:
        """Sends the request upstream; the answer's status line and headers."""
        upstream.sock.sendall(render(start, headers) + body)
        status_line, resp_headers = upstream.head()
        while 100 <= int(status_line.split()[1]) < 200:
            status_line, resp_headers = upstream.head()  # interim answers are the proxy's business
        return status_line, resp_headers

    def _relay(
        self, upstream: Conn, client: socket.socket, method: str, status_line: bytes, headers: list[tuple[str, str]]
    ) -> bool:
        """Relays the answer as it comes; whether the server closes the connection after it."""
        client.sendall(render(status_line, headers))
        closes = (header(headers, "connection") or "").lower() == "close"
        if method == "HEAD" or int(status_line.split()[1]) in (204, 304):
            return closes
        if (header(headers, "transfer-encoding") or "").lower() == "chunked":
            self._relay_chunks(upstream, client)
        elif (length := header(headers, "content-length")) is not None:
            client.sendall(upstream.exact(int(length)))
        else:
            client.sendall(upstream.until_close())
            closes = True
        return closes

    @staticmethod
    def _relay_chunks(upstream: Conn, client: socket.socket) -> None:
        """A chunked body, each chunk passed on as it arrives (a watch's events, one by one)."""
        while True:
            size_line = upstream.line()
            client.sendall(size_line)
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while (trailer := upstream.line()) != b"\r\n":
                    client.sendall(trailer)
                client.sendall(b"\r\n")
                return
            client.sendall(upstream.exact(size + 2))
