"""One Node played by the agent: registration, Lease and status heartbeats, the pod watch,
the kubelet API (``kubectl logs``), and the failure modes (graceful shutdown, abrupt loss).

Each Node talks to the API server as itself (user ``system:node:<name>``, group
``system:nodes``), so the Node authorizer and the NodeRestriction admission plugin apply
to it as they do to a real kubelet.
"""

from __future__ import annotations

import datetime as dt
import logging
import ssl
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from spotrl_e2e.forkserver import ForkServer
from spotrl_e2e.kube import STRATEGIC, ApiError, Credentials, KubeClient
from spotrl_e2e.nodeagent.config import AgentConfig, NodeSpec
from spotrl_e2e.nodeagent.pods import PodWorker, now_rfc3339
from spotrl_e2e.pki import KeyPair

log = logging.getLogger("nodeagent.node")
Obj = dict[str, Any]

LEASE_NS = "kube-node-lease"
WATCH_SECONDS = 20


def _micro_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Node:
    """States: ``running``, ``shutting-down``, ``shutdown`` (graceful, heartbeats stopped),
    ``lost`` (abrupt: processes killed, heartbeats stopped)."""

    def __init__(self, config: AgentConfig, spec: NodeSpec, index: int):
        self.config = config
        self.forkserver: ForkServer | None = None  # the agent's, set when it adds the node
        self.spec = spec
        self.name = spec.name
        self.index = index
        self.ip = f"127.0.{index}.1"
        pki = Path(config.pki_dir)
        self.client = KubeClient(
            Credentials(
                config.server,
                Path(config.ca),
                client=KeyPair(pki / f"node-{self.name}.crt", pki / f"node-{self.name}.key"),
            )
        )
        self.serving = KeyPair(pki / f"node-{self.name}-serving.crt", pki / f"node-{self.name}-serving.key")
        self.state = "stopped"
        self.workers: dict[str, PodWorker] = {}
        self._lock = threading.RLock()
        self._ips: set[str] = set()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._kubelet: ThreadingHTTPServer | None = None
        self.kubelet_port = 0
        self.boot_id = ""
        self._ready_since = now_rfc3339()
        self._ready = False
        self._lease: Obj | None = None
        self.uid = ""

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Registers the Node (again, after a loss) and starts its heartbeats and pod watch."""
        with self._lock:
            self._stop = threading.Event()
            self.boot_id = str(uuid.uuid4())
            self._start_kubelet_api()
            self._register()
            self.state = "running"
            stop = self._stop
            self._threads = [
                threading.Thread(target=self._heartbeats, args=(stop,), name=f"heartbeat-{self.name}", daemon=True),
                threading.Thread(target=self._watch_pods, args=(stop,), name=f"watch-{self.name}", daemon=True),
            ]
            for t in self._threads:
                t.start()

    def _stop_loops(self) -> None:
        self._stop.set()
        if self._kubelet is not None:
            self._kubelet.shutdown()
            self._kubelet.server_close()
            self._kubelet = None

    def lose(self) -> None:
        """Abrupt loss: every process is SIGKILLed and the node stops talking to the API server."""
        with self._lock:
            self.state = "lost"
            self._stop_loops()
            workers = list(self.workers.values())
        for w in workers:
            w.kill_now()
        for w in workers:
            w.join(10)

    def shutdown(self, grace_cap: float) -> None:
        """Graceful node shutdown (kubelet's GracefulNodeShutdown): NotReady, every pod gets
        SIGTERM and at most ``grace_cap`` seconds (PDBs do not apply), is marked Failed with a
        DisruptionTarget condition, then the node stops heartbeating."""
        with self._lock:
            if self.state != "running":
                raise RuntimeError(f"node {self.name} is {self.state}, not running")
            self.state = "shutting-down"
            workers = list(self.workers.values())
        self._ready = False
        self._post_status(message="node is shutting down")
        for w in workers:
            w.node_shutdown(grace_cap)
        deadline = time.monotonic() + grace_cap + 15
        for w in workers:
            while time.monotonic() < deadline and w.is_alive() and not w.terminal:
                time.sleep(0.1)
        with self._lock:
            self._stop_loops()
            self.state = "shutdown"
            workers = list(self.workers.values())
        for w in workers:
            w.kill_now()

    def restore(self) -> None:
        """A lost or shut-down node boots again: it re-registers and runs its pods anew."""
        with self._lock:
            if self.state == "running":
                return
            for w in list(self.workers.values()):
                w.kill_now()
        self.start()

    def stop(self) -> None:
        """The agent exits: kill every process, say nothing."""
        self.lose()

    # ------------------------------------------------------------------ registration & heartbeats
    def _node_object(self) -> Obj:
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "labels": self.spec.all_labels()},
            "spec": {"taints": [t.to_api() for t in self.spec.taints]} if self.spec.taints else {},
        }

    def _register(self) -> None:
        try:
            node = self.client.create("/api/v1/nodes", self._node_object())
        except ApiError as err:
            if err.status != 409:
                raise
            node = self.client.get(f"/api/v1/nodes/{self.name}")
        self.uid = node["metadata"]["uid"]
        self._ready = True
        self._ready_since = now_rfc3339()
        self._post_status()
        self._lease = None
        self._renew_lease()

    def _post_status(self, message: str = "") -> None:
        now = now_rfc3339()
        cap = self.spec.capacity()

        def cond(kind: str, status: str, reason: str, msg: str, since: str) -> Obj:
            return {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": msg,
                "lastHeartbeatTime": now,
                "lastTransitionTime": since,
            }

        if self._ready:
            ready = cond("Ready", "True", "KubeletReady", "kubelet is posting ready status", self._ready_since)
        else:
            ready = cond("Ready", "False", "KubeletNotReady", message or "kubelet is not ready", now)
        status = {
            "capacity": cap,
            "allocatable": cap,
            "conditions": [
                cond(
                    "MemoryPressure",
                    "False",
                    "KubeletHasSufficientMemory",
                    "kubelet has sufficient memory available",
                    self._ready_since,
                ),
                cond(
                    "DiskPressure",
                    "False",
                    "KubeletHasNoDiskPressure",
                    "kubelet has no disk pressure",
                    self._ready_since,
                ),
                cond(
                    "PIDPressure",
                    "False",
                    "KubeletHasSufficientPID",
                    "kubelet has sufficient PID available",
                    self._ready_since,
                ),
                ready,
            ],
            "addresses": [{"type": "InternalIP", "address": self.ip}, {"type": "Hostname", "address": self.name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.kubelet_port}},
            "nodeInfo": {
                "machineID": uuid.uuid5(uuid.NAMESPACE_DNS, self.name).hex,
                "systemUUID": str(uuid.uuid5(uuid.NAMESPACE_URL, self.name)),
                "bootID": self.boot_id,
                "kernelVersion": "spotrl-nodeagent",
                "osImage": "SpotRL node agent (pods are local processes)",
                "containerRuntimeVersion": "spotrl://0.1",
                "kubeletVersion": self.config.kubelet_version,
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }
        self.client.patch(f"/api/v1/nodes/{self.name}/status", {"status": status}, STRATEGIC)

    def _renew_lease(self) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NS}/leases/{self.name}"
        if self._lease is None:
            self._lease = self.client.get_or_none(path)
        if self._lease is None:
            self._lease = self.client.create(
                f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NS}/leases",
                {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {
                        "name": self.name,
                        "namespace": LEASE_NS,
                        "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": self.name, "uid": self.uid}],
                    },
                    "spec": {
                        "holderIdentity": self.name,
                        "leaseDurationSeconds": self.config.lease_seconds,
                        "renewTime": _micro_now(),
                    },
                },
            )
            return
        lease = self._lease
        lease["spec"]["renewTime"] = _micro_now()
        lease["spec"]["holderIdentity"] = self.name
        try:
            self._lease = self.client.replace(path, lease)
        except ApiError as err:
            self._lease = None  # conflict or gone: read it again next time
            if err.status not in (404, 409):
                raise

    def _heartbeats(self, stop: threading.Event) -> None:
        cfg = self.config
        last_status = time.monotonic()
        while not stop.wait(cfg.lease_renew_seconds):
            try:
                self._renew_lease()
                if time.monotonic() - last_status >= cfg.status_seconds:
                    self._post_status()
                    last_status = time.monotonic()
            except Exception as err:
                log.warning("node %s: heartbeat failed: %s", self.name, err)

    # ------------------------------------------------------------------ pods
    def _watch_pods(self, stop: threading.Event) -> None:
        collection = "/api/v1/pods"
        selector = {"fieldSelector": f"spec.nodeName={self.name}"}
        first = True
        while not stop.is_set():
            try:
                listed = self.client.get(collection, **selector)
                items = listed.get("items", [])
                for pod in items:
                    self._handle("LISTED" if first else "MODIFIED", pod, stop)
                # Pods deleted while the watch was down.
                present = {p["metadata"]["uid"] for p in items}
                with self._lock:
                    gone = [w for uid, w in self.workers.items() if uid not in present]
                for w in gone:
                    self._handle("DELETED", w.pod, stop)
                first = False
                rv = listed["metadata"]["resourceVersion"]
                while not stop.is_set():
                    for event in self.client.watch(collection, rv, WATCH_SECONDS, stop.is_set, **selector):
                        if event["type"] == "BOOKMARK":
                            rv = event["object"]["metadata"]["resourceVersion"]
                            continue
                        rv = event["object"]["metadata"]["resourceVersion"]
                        self._handle(event["type"], event["object"], stop)
            except ApiError as err:
                if err.status != 410:
                    log.warning("node %s: pod watch: %s", self.name, err)
                    stop.wait(1.0)
            except Exception as err:
                log.warning("node %s: pod watch failed, listing again: %s", self.name, err)
                stop.wait(1.0)

    def _handle(self, kind: str, pod: Obj, stop: threading.Event) -> None:
        if stop.is_set():
            return
        uid = pod["metadata"]["uid"]
        with self._lock:
            worker = self.workers.get(uid)
            if kind == "DELETED":
                if worker is not None:
                    meta = pod["metadata"]
                    meta.setdefault("deletionTimestamp", now_rfc3339())
                    meta.setdefault("deletionGracePeriodSeconds", 0)
                    worker.update(pod)
                return
            if worker is not None:
                worker.update(pod)
                return
            phase = (pod.get("status") or {}).get("phase")
            deleting = bool(pod["metadata"].get("deletionTimestamp"))
            if phase in ("Succeeded", "Failed") and not deleting:
                return
            if self.state != "running" and not deleting:
                self._reject(pod)
                return
            # A pod that was already started (by this node before a loss, or by an earlier agent)
            # has lost its processes: it is adopted as after a reboot.
            started = bool((pod.get("status") or {}).get("containerStatuses"))
            worker = PodWorker(self, pod, after_reboot=started and kind == "LISTED")
            self.workers[uid] = worker
        worker.start()

    def _reject(self, pod: Obj) -> None:
        """A pod bound while the node shuts down fails at once, as the kubelet rejects it."""
        if (pod.get("status") or {}).get("containerStatuses"):
            return
        status = {
            "phase": "Failed",
            "reason": "NodeShutdown",
            "message": "Pod was rejected as the node is shutting down.",
        }
        meta = pod["metadata"]
        try:
            self.client.patch(
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status", {"status": status}, STRATEGIC
            )
        except ApiError as err:
            log.info("node %s: could not reject pod %s: %s", self.name, meta["name"], err)

    def forget(self, uid: str, worker: PodWorker) -> None:
        with self._lock:
            if self.workers.get(uid) is worker:
                del self.workers[uid]

    def allocate_ip(self) -> str:
        with self._lock:
            for host in range(2, 255):
                ip = f"127.0.{self.index}.{host}"
                if ip not in self._ips:
                    self._ips.add(ip)
                    return ip
        raise RuntimeError(f"node {self.name}: no free pod address left in 127.0.{self.index}.0/24")

    def release_ip(self, ip: str) -> None:
        with self._lock:
            self._ips.discard(ip)

    def event(self, pod: Obj, reason: str, message: str, kind: str = "Normal") -> None:
        """Records a kubelet Event on the pod (best effort)."""
        meta = pod["metadata"]
        now = now_rfc3339()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta["uid"],
            },
            "reason": reason,
            "message": message,
            "type": kind,
            "source": {"component": "kubelet", "host": self.name},
            "reportingComponent": "kubelet",
            "reportingInstance": self.name,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.client.create(f"/api/v1/namespaces/{meta['namespace']}/events", body)
        except Exception as err:
            log.debug("event not recorded: %s", err)

    def describe(self) -> Obj:
        with self._lock:
            workers = list(self.workers.values())
        return {
            "name": self.name,
            "state": self.state,
            "ip": self.ip,
            "kubeletPort": self.kubelet_port,
            "pods": [w.describe() for w in workers],
        }

    # ------------------------------------------------------------------ kubelet API (logs)
    def _start_kubelet_api(self) -> None:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.config.ca)
        ctx.load_cert_chain(str(self.serving.cert), str(self.serving.key))
        ctx.verify_mode = ssl.CERT_REQUIRED
        node = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                log.debug("kubelet api %s: " + format, node.name, *args)

            def do_GET(self) -> None:
                cert = self.connection.getpeercert() if isinstance(self.connection, ssl.SSLSocket) else None
                names = [attr for rdn in (cert or {}).get("subject", ()) for attr in rdn]
                if ("commonName", "kube-apiserver-kubelet-client") not in names:
                    self.send_error(403, "only the API server may use the kubelet API")
                    return
                url = urlparse(self.path)
                parts = url.path.strip("/").split("/")
                if url.path == "/healthz":
                    self._send(b"ok")
                elif len(parts) == 4 and parts[0] == "containerLogs":
                    node._serve_logs(self, parts[1], parts[2], parts[3], parse_qs(url.query))
                else:
                    self.send_error(404, f"the node agent's kubelet API serves /containerLogs only, not {url.path}")

            def _send(self, body: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        server = ThreadingHTTPServer((self.ip, self.kubelet_port), Handler)
        server.daemon_threads = True
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
        self.kubelet_port = server.server_address[1]
        self._kubelet = server
        threading.Thread(target=server.serve_forever, name=f"kubelet-api-{self.name}", daemon=True).start()

    def _serve_logs(
        self, handler: BaseHTTPRequestHandler, ns: str, pod: str, container: str, query: dict[str, list[str]]
    ) -> None:
        dirs = sorted(
            (Path(self.config.workdir) / "pods").glob(f"{ns}_{pod}_*"), key=lambda p: p.stat().st_mtime, reverse=True
        )
        logs = (
            sorted(dirs[0].glob(f"logs/{container}.[0-9]*.log"), key=lambda p: int(p.name.split(".")[-2]))
            if dirs
            else []
        )
        if query.get("previous", ["false"])[0] == "true":
            logs = logs[:-1]
        if not logs:
            handler.send_error(404, f"no logs of container {container} in pod {ns}/{pod} on node {self.name}")
            return
        path = logs[-1]
        data = path.read_bytes()
        if "tailLines" in query:
            n = int(query["tailLines"][0])
            data = b"".join(data.splitlines(keepends=True)[-n:]) if n > 0 else b""
        handler.send_response(200)
        handler.send_header("Content-Type", "text/plain")
        handler.end_headers()
        handler.wfile.write(data)
        if query.get("follow", ["false"])[0] != "true":
            return
        offset = path.stat().st_size
        while self._container_running(ns, pod, container) or path.stat().st_size > offset:
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            if chunk:
                handler.wfile.write(chunk)
                handler.wfile.flush()
                offset += len(chunk)
            time.sleep(0.2)

    def _container_running(self, ns: str, pod: str, container: str) -> bool:
        with self._lock:
            workers = list(self.workers.values())
        for w in workers:
            if w.ns == ns and w.pod_name == pod:
                return any(c.name == container and c.running for c in w.containers)
        return False
