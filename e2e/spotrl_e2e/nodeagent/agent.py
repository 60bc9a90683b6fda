"""The node agent process: its Nodes and a small HTTP control channel on loopback.

Control channel (JSON over HTTP on 127.0.0.1:<control_port>):

- ``GET  /healthz``                    ok once every Node is registered
- ``GET  /nodes``                      each Node's state and pods
- ``POST /nodes``                      add a Node (body: a NodeSpec; its certificates must exist)
- ``POST /nodes/<name>/lose``          abrupt loss: SIGKILL every process, stop heartbeats
- ``POST /nodes/<name>/shutdown``      graceful shutdown, body ``{"grace_seconds": 15}``; returns
                                       at once, ``GET /nodes`` shows ``shutdown`` when done
- ``POST /nodes/<name>/restore``       the node boots again and re-registers
"""

from __future__ import annotations

import json
import logging
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from spotrl_e2e.forkserver import FORK_VAR, ForkServer
from spotrl_e2e.nodeagent.config import AgentConfig, NodeSpec
from spotrl_e2e.nodeagent.node import Node
from spotrl_e2e.nodeagent.pods import image_env

log = logging.getLogger("nodeagent")


class Agent:
    """Plays kubelet for every Node in its config."""

    def __init__(self, config: AgentConfig):
        self.config = config
        self.server = config.server
        self.ca = config.ca
        self.workdir = Path(config.workdir)
        self.python_bin = config.python_bin
        self.nodes: dict[str, Node] = {}
        self._lock = threading.Lock()
        self._control: ThreadingHTTPServer | None = None
        self.ready = threading.Event()
        self.forkserver: ForkServer | None = None

    def add_node(self, spec: NodeSpec, index: int | None = None) -> Node:
        """Starts playing one more Node. ``index`` picks its addresses, 127.0.<index>.0/24; the
        harness chooses it because the node's serving certificate names that address."""
        with self._lock:
            if spec.name in self.nodes:
                raise ValueError(f"node {spec.name} exists already")
            index = index or len(self.nodes) + 1
            if not 1 <= index <= 254 or index in {n.index for n in self.nodes.values()}:
                raise ValueError(f"node index {index} is taken or outside 1..254")
            node = Node(self.config, spec, index)
            node.forkserver = self.forkserver
            self.nodes[spec.name] = node
        node.start()
        return node

    def run(self) -> None:
        """Starts the control channel and every Node; returns when they are up. Pods that run
        ``spotrl`` are forked from a warm parent (:mod:`spotrl_e2e.forkserver`), started here on
        the main thread since it dies with the thread that started it."""
        if os.environ.get(FORK_VAR, "1") != "0":
            home = self.workdir / "forkserver"
            home.mkdir(parents=True, exist_ok=True)
            self.forkserver = ForkServer(image_env(self.config, home), home, die_with_parent=True)
        self._serve_control()
        for spec in self.config.nodes:
            self.add_node(spec)
        self.ready.set()
        log.info("node agent up: %s", ", ".join(self.nodes))

    def stop(self) -> None:
        for node in list(self.nodes.values()):
            node.stop()
        if self._control is not None:
            self._control.shutdown()

    def node(self, name: str) -> Node:
        if name not in self.nodes:
            raise KeyError(f"no node {name!r}; the agent has {sorted(self.nodes)}")
        return self.nodes[name]

    def _serve_control(self) -> None:
        agent = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                log.debug("control: " + format, *args)

            def _reply(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/healthz":
                    self._reply(200 if agent.ready.is_set() else 503, {"ready": agent.ready.is_set()})
                elif self.path == "/nodes":
                    self._reply(200, [n.describe() for n in agent.nodes.values()])
                else:
                    self._reply(404, {"error": f"no route GET {self.path}"})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                parts = self.path.strip("/").split("/")
                try:
                    if parts == ["nodes"]:
                        index = body.pop("index", None)
                        self._reply(201, agent.add_node(NodeSpec.from_dict(body), index).describe())
                    elif len(parts) == 3 and parts[0] == "nodes":
                        node = agent.node(parts[1])
                        if parts[2] == "lose":
                            node.lose()
                        elif parts[2] == "restore":
                            node.restore()
                        elif parts[2] == "shutdown":
                            if node.state != "running":
                                raise ValueError(f"node {node.name} is {node.state}, not running")
                            grace = float(body.get("grace_seconds", 15))
                            threading.Thread(target=node.shutdown, args=(grace,), daemon=True).start()
                        else:
                            raise KeyError(f"no action {parts[2]!r}: lose, restore or shutdown")
                        self._reply(200, node.describe())
                    else:
                        self._reply(404, {"error": f"no route POST {self.path}"})
                except (KeyError, ValueError, RuntimeError) as err:
                    self._reply(400, {"error": str(err)})
                except Exception as err:
                    log.exception("control %s", self.path)
                    self._reply(500, {"error": f"{type(err).__name__}: {err}"})

        server = ThreadingHTTPServer(("127.0.0.1", self.config.control_port), Handler)
        server.daemon_threads = True
        self._control = server
        threading.Thread(target=server.serve_forever, name="control", daemon=True).start()
