"""What the test proxies share: just enough HTTP/1.1 framing to relay a message exactly
(:class:`Conn`: a start line, headers, a body by ``Content-Length`` or chunked), and
:class:`LoopbackServer`: a listener on a loopback port with a thread per connection, whose
:meth:`~LoopbackServer.close` ends every connection and joins every thread it started.
:mod:`~spotrl_e2e.faultproxy` (an S3 store's faults) and :mod:`~spotrl_e2e.watch_gap_proxy`
(a watch gap of the API server) build on it."""

from __future__ import annotations

import abc
import contextlib
import socket
import threading
from typing import Any


class ClosedError(Exception):
    """The connection ended (or the proxy is closing)."""


class Conn:
    """A socket with a read buffer and line/exact reads."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = b""

    def _fill(self) -> None:
        data = self.sock.recv(256 * 1024)
        if not data:
            raise ClosedError
        self.buf += data

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            if len(self.buf) > 64 * 1024:
                raise ClosedError
            self._fill()
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line + b"\r\n"

    def exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def until_close(self) -> bytes:
        with contextlib.suppress(ClosedError, OSError):
            while True:
                self._fill()
        out, self.buf = self.buf, b""
        return out

    def head(self) -> tuple[bytes, list[tuple[str, str]]]:
        """The start line and the headers (raw start line, parsed headers)."""
        start = self.line()
        while start == b"\r\n":  # tolerate stray blank lines between messages
            start = self.line()
        headers: list[tuple[str, str]] = []
        while (line := self.line()) != b"\r\n":
            name, _, value = line.decode("latin-1").partition(":")
            headers.append((name.strip(), value.strip()))
        return start, headers

    def chunked(self) -> bytes:
        """A chunked body, raw (sizes, chunks and trailers), ending with its last CRLF."""
        out = b""
        while True:
            size_line = self.line()
            out += size_line
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while (trailer := self.line()) != b"\r\n":
                    out += trailer
                return out + b"\r\n"
            out += self.exact(size + 2)


def header(headers: list[tuple[str, str]], name: str) -> str | None:
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


def render(start: bytes, headers: list[tuple[str, str]]) -> bytes:
    return start + "".join(f"{k}: {v}\r\n" for k, v in headers).encode("latin-1") + b"\r\n"


class LoopbackServer(abc.ABC):
    """Listens on 127.0.0.1 (:attr:`port`) and serves each connection in a thread of its own
    (:meth:`_serve`, the subclass's). A subclass sets itself up, then calls :meth:`_start`."""

    name = "proxy"
    """Its threads' names start with this."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._threads: list[threading.Thread] = []
        self._socks: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port: int = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept, name=f"{self.name}-accept")

    def _start(self) -> None:
        self._acceptor.start()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abc.abstractmethod
    def _serve(self, sock: socket.socket) -> None:
        """Serves one accepted connection until it ends (in its own thread)."""

    def _track(self, sock: socket.socket) -> bool:
        """Remembers a connection to end at :meth:`close`; False once closing (then close it)."""
        with self._lock:
            if self._closing.is_set():
                return False
            self._socks.add(sock)
            return True

    def _untrack(self, *socks: socket.socket, close: bool = False) -> None:
        with self._lock:
            for sock in socks:
                self._socks.discard(sock)
                if close:
                    with contextlib.suppress(OSError):
                        sock.close()

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            if not self._track(client):
                client.close()
                return
            t = threading.Thread(target=self._serve, args=(client,), name=f"{self.name}-conn")
            with self._lock:
                self._threads = [x for x in self._threads if x.is_alive()]
                self._threads.append(t)
            t.start()

    def close(self) -> None:
        """Stops accepting, ends every connection (stalls and watches included) and joins the threads."""
        self._closing.set()
        self._acceptor.join(10)
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            socks = list(self._socks)
        for sock in socks:  # their threads close them; the plain socket's shutdown, for TLS ones too
            with contextlib.suppress(OSError):
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(10)
        leftover = [t.name for t in [self._acceptor, *threads] if t.is_alive()]
        if leftover:
            raise RuntimeError(f"{self.name} threads still running after close: {leftover}")
