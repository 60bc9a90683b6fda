"""The controller's HTTP endpoint: Prometheus metrics, status, and barrier requests.

- ``GET /metrics``: Prometheus text format (see :mod:`spotrl_runtime.controller.metrics`);
- ``GET /status``: JSON — step, attempt, owners, last cut, counters;
- ``POST /barrier`` with ``{"reason": "...", "deadlineSeconds": 30}``: takes a barrier cut
  and answers with the committed cut (200) or why it failed (503). After it the controller
  is parked until it is stopped, as after any barrier.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from spotrl_runtime.api.times import Deadline
from spotrl_runtime.controller.control import BarrierFailed


class ControlServer:
    """Serves one controller on ``host:port`` (port 0: any free port) in a daemon thread."""

    def __init__(self, controller: Any, registry: Any, host: str, port: int):
        self.controller = controller
        self.registry = registry
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # quiet: the controller logs what matters
                return

            def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/metrics":
                    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

                    self._send(200, generate_latest(server.registry), CONTENT_TYPE_LATEST)
                elif self.path == "/status":
                    self._send(200, json.dumps(status_of(server.controller), default=str).encode())
                else:
                    self._send(404, b'{"error": "not found: use /metrics, /status or POST /barrier"}')

            def do_POST(self) -> None:
                if self.path != "/barrier":
                    self._send(404, b'{"error": "not found: POST /barrier"}')
                    return
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                    seconds = float(body.get("deadlineSeconds", 30))
                    reason = str(body.get("reason", "http"))
                except (ValueError, AttributeError) as err:
                    self._send(400, json.dumps({"error": f"body must be JSON with deadlineSeconds: {err}"}).encode())
                    return
                try:
                    cut = server.controller.request_barrier(reason, Deadline.after(seconds))
                except BarrierFailed as err:
                    self._send(503, json.dumps({"error": str(err)}).encode())
                    return
                self._send(200, json.dumps(cut.__dict__).encode())

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.address = f"http://{host}:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="http", daemon=True)

    def start(self) -> ControlServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def status_of(controller: Any) -> dict[str, Any]:
    """What /status shows: where the run is and who owns what."""
    owners = controller.owners
    return {
        "job": controller.job.name,
        "attempt": owners.attempt,
        "step": owners.trainer_step,
        "target_steps": controller.target_steps,
        "dispatch_index": owners.dispatch_index,
        "parked": controller.parked,
        "in_flight": len(owners.in_flight()),
        "last_cut": controller.cuts[-1].__dict__ if controller.cuts else None,
        "resumed_from": controller.resumed_from.__dict__ if controller.resumed_from else None,
        "counters": owners.counters.__dict__,
        "stats": dict(controller.stats),
    }
