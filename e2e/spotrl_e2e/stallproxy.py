"""A TCP relay for tests that can stall: a network partition between one client and a server.

Unlike :mod:`spotrl_e2e.faultproxy` it reads nothing of what it relays, so it sits in front of
a TLS server (the API server) as well. :meth:`StallProxy.stall` stops relaying in both
directions without closing anything: every request in flight, and every new one, hangs, as
over a link that silently drops packets. A connection the client closes while stalled is
dropped with what it had sent, never delivered late. :meth:`StallProxy.close` ends it all.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading

CHUNK = 65536


class StallProxy:
    """Listens on 127.0.0.1 (:attr:`port`) and relays each connection to ``upstream`` (host, port)."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = threading.Event()
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._threads = [threading.Thread(target=self._accept, name="stallproxy-accept", daemon=True)]
        self._threads[0].start()

    def stall(self) -> None:
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def close(self) -> None:
        self._closed.set()
        self._flowing.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            for s in self._socks:
                with contextlib.suppress(OSError):
                    s.close()
        for t in self._threads:
            t.join(5)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks.update((client, server))
            t = threading.Thread(target=self._relay, args=(client, server), name="stallproxy-relay", daemon=True)
            self._threads.append(t)
            t.start()

    def _relay(self, client: socket.socket, server: socket.socket) -> None:
        peer = {client: server, server: client}
        try:
            while not self._closed.is_set():
                if not self._flowing.wait(0.1):
                    if _closed_by_peer(client):
                        return  # the client gave up while stalled: what it sent is never delivered
                    continue
                ready, _, _ = select.select([client, server], [], [], 0.1)
                for s in ready:
                    data = s.recv(CHUNK)
                    if not data:
                        return
                    peer[s].sendall(data)
        except (OSError, ValueError):  # ValueError: a socket closed by close() meanwhile
            return
        finally:
            for s in (client, server):
                with contextlib.suppress(OSError):
                    s.close()


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end closed the connection (without reading what it may have sent)."""
    try:
        ready, _, _ = select.select([sock], [], [], 0)
        return bool(ready) and sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True
