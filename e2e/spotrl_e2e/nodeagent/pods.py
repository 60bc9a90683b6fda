"""One pod on one node: its containers as local processes, and its status as a kubelet reports it.

A :class:`PodWorker` thread owns a pod from the moment it is bound to the node until its
object is deleted: it prepares the pod's folder (volumes, service-account token, a
kubeconfig), runs the init containers one after the other and then the regular containers,
restarts them by the restart policy with a back-off, patches ``pods/status`` whenever
something changes, and on deletion runs the preStop hooks, sends SIGTERM to each
container's main process, waits out the grace period, SIGKILLs what is left and deletes
the pod object (grace 0), as the kubelet does.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from spotrl_e2e.forkserver import Child, ForkServer
from spotrl_e2e.kube import STRATEGIC, ApiError
from spotrl_e2e.nodeagent import podspec
from spotrl_e2e.nodeagent.podspec import Obj, PodConfigError
from spotrl_e2e.pki import write_kubeconfig
from spotrl_e2e.procs import die_with_parent

if TYPE_CHECKING:
    from spotrl_e2e.kube import KubeClient
    from spotrl_e2e.nodeagent.config import AgentConfig


class Node(Protocol):
    """What a pod worker uses of the node that runs it (:class:`spotrl_e2e.nodeagent.node.Node`)."""

    config: AgentConfig
    client: KubeClient
    ip: str
    forkserver: ForkServer | None

    def allocate_ip(self) -> str: ...
    def release_ip(self, ip: str) -> None: ...
    def forget(self, uid: str, worker: PodWorker) -> None: ...
    def event(self, pod: Obj, reason: str, message: str, kind: str = "Normal") -> None: ...


log = logging.getLogger("nodeagent.pods")

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
TICK = 0.2
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
HOST_SHARED = frozenset({"/tmp", "/dev/shm"})
"""Mount paths a local process shares with the host: their volumes are made, but a path under
them is not rewritten (a test points TMPDIR, storage and failpoints at its own /tmp folder)."""


def image_env(cfg: AgentConfig, home: Path) -> dict[str, str]:
    """What every container's environment starts from: the image's (``cfg.image_env``) and a
    home folder; the pod's own variables come on top."""
    return {
        "PATH": f"{cfg.python_bin}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
        **cfg.image_env,
    }


def release_source(cfg: AgentConfig, image: str) -> Path | None:
    """The code of another release that ``image`` runs (``cfg.image_sources``), or None: this
    checkout's."""
    tag = image.rsplit("/", 1)[-1].partition(":")[2]
    if not cfg.image_sources or not tag or tag.startswith("."):  # a tag never starts with a dot
        return None
    source = Path(cfg.image_sources) / tag / "runtime"
    return source if source.is_dir() else None


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def exit_code(returncode: int) -> int:
    """A signal death as container runtimes report it: 128 + signal number."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass
class Container:
    """One container of the pod and its current process."""

    spec: Obj
    init: bool = False
    proc: subprocess.Popen[bytes] | Child | None = None
    restart_count: int = 0
    state: Obj = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: Obj = field(default_factory=dict)
    started_at: float = 0.0
    next_start: float = 0.0
    backoff: float = 0.0
    done: bool = False  # exited and will not be restarted
    killed_by_agent: bool = False

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class PodWorker(threading.Thread):
    """Runs one pod on one node; see the module docstring."""

    def __init__(self, node: Node, pod: Obj, after_reboot: bool = False):
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.node = node
        self.pod = pod
        self.uid: str = meta["uid"]
        self.ns: str = meta["namespace"]
        self.pod_name: str = meta["name"]
        self.after_reboot = after_reboot
        self.dir = Path(node.config.workdir) / "pods" / f"{self.ns}_{self.pod_name}_{self.uid[:8]}"
        self.root = self.dir / "root"
        self.ip = ""
        self.start_time = now_rfc3339()
        self.containers = [Container(c, init=True) for c in pod["spec"].get("initContainers", []) or []]
        self.containers += [Container(c) for c in pod["spec"]["containers"]]
        self.mounts: dict[str, dict[str, Path]] = {}
        self.phase = "Pending"
        self.reason: str | None = None
        self.message: str | None = None
        self.disruption: Obj | None = None
        self._lock = threading.Lock()
        self._changed = threading.Event()
        self._killed = threading.Event()
        self._shutdown_grace: float | None = None
        self._last_status = ""
        self._api_token: str | None = None

    # ------------------------------------------------------------------ signals from the node
    def update(self, pod: Obj) -> None:
        """A newer version of the pod object arrived (from the node's watch)."""
        with self._lock:
            self.pod = pod
        self._changed.set()

    def kill_now(self) -> None:
        """Abrupt node loss: every process dies, nothing more is reported."""
        self._killed.set()
        self._changed.set()

    def node_shutdown(self, grace_cap: float) -> None:
        """Graceful node shutdown: terminate within min(pod grace, cap), ignoring PDBs."""
        self._shutdown_grace = grace_cap
        self._changed.set()

    @property
    def deleting(self) -> bool:
        return bool(self.pod["metadata"].get("deletionTimestamp"))

    @property
    def terminal(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    # ------------------------------------------------------------------ main loop
    def run(self) -> None:
        try:
            self._run()
        except _NodeLostError:
            self._kill_all()
        except Exception:
            log.exception("pod %s/%s: worker failed", self.ns, self.pod_name)
            self._kill_all()
        finally:
            if self.ip:
                self.node.release_ip(self.ip)
            self.node.forget(self.uid, self)

    def _run(self) -> None:
        if self.deleting:
            self._finalize()
            return
        self.ip = self.node.allocate_ip()
        try:
            if self.after_reboot:
                self._adopt_after_reboot()
            if not self.terminal:
                self._report()
                self._prepare_with_retries()
                if self._run_init_containers():
                    for c in self._regular():
                        self._start(c)
                    self._report()
                    self._supervise()
        except _PodTerminalError:
            pass
        except _PodDeletedError:
            return
        self._idle_until_deleted()

    def _check(self) -> None:
        if self._killed.is_set():
            raise _NodeLostError
        if self._shutdown_grace is not None and not self.terminal:
            self._terminate(min(float(podspec.grace_period(self.pod)), self._shutdown_grace))
            self.phase, self.reason = "Failed", "Terminated"
            self.message = "Pod was terminated in response to imminent node shutdown."
            self.disruption = {
                "type": "DisruptionTarget",
                "status": "True",
                "reason": "TerminationByKubelet",
                "message": "Pod was terminated in response to imminent node shutdown.",
                "lastTransitionTime": now_rfc3339(),
            }
            self._report()
            raise _PodTerminalError
        if self.deleting:
            self._terminate(float(podspec.grace_period(self.pod)))
            self._finish_phase_after_kill()
            self._report()
            self._finalize()
            raise _PodDeletedError

    def _wait(self, seconds: float) -> None:
        self._changed.wait(seconds)
        self._changed.clear()

    def _idle_until_deleted(self) -> None:
        while True:
            if self._killed.is_set():
                raise _NodeLostError
            if self.deleting:
                self._finalize()
                return
            self._wait(1.0)

    def _regular(self) -> list[Container]:
        return [c for c in self.containers if not c.init]

    # ------------------------------------------------------------------ preparation
    def _prepare_with_retries(self) -> None:
        while True:
            try:
                self._check()
                self._prepare()
                return
            except (PodConfigError, ApiError) as err:
                # 403 right after binding: the node authorizer has not yet seen the pod's references.
                message = str(err)
                for c in self.containers:
                    c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": message}}
                self._report()
                self._wait(1.0)

    def _prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.dir / "logs").mkdir(exist_ok=True)
        volumes = {}
        for vol in self.pod["spec"].get("volumes", []) or []:
            volumes[vol["name"]] = self._volume(vol)
        for c in self.containers:
            mounts: dict[str, Path] = {}
            for m in c.spec.get("volumeMounts", []) or []:
                if m["name"] not in volumes:
                    raise PodConfigError(f"containers[{c.name}].volumeMounts: no volume named {m['name']!r}")
                local = volumes[m["name"]] / m["subPath"] if m.get("subPath") else volumes[m["name"]]
                local.mkdir(parents=True, exist_ok=True)
                if m["mountPath"] in HOST_SHARED:
                    continue
                mounts[m["mountPath"]] = local
                link = self.root / m["mountPath"].lstrip("/")
                if not link.exists() and not link.is_symlink():
                    link.parent.mkdir(parents=True, exist_ok=True)
                    link.symlink_to(local)
            # The kubelet bind-mounts a file at terminationMessagePath; here it is a file in the
            # pod's folder, and a command line or env value naming the path is rewritten to it.
            log = self._termination_log(c)
            log.write_bytes(b"")
            mounts[c.spec.get("terminationMessagePath") or TERMINATION_MESSAGE_PATH] = log
            self.mounts[c.name] = mounts

    def _termination_log(self, c: Container) -> Path:
        return self.dir / f"termination-{c.name}.log"

    def _termination_message(self, c: Container, code: int) -> str:
        """What the kubelet puts in ``state.terminated.message``: the termination log file (at
        most 4 KiB), else with ``FallbackToLogsOnError`` and a failure the log's last lines."""
        try:
            message = self._termination_log(c).read_bytes()[:4096].decode(errors="replace")
        except OSError:
            message = ""
        if not message.strip() and code != 0 and c.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            logfile = self.dir / "logs" / f"{c.name}.{c.restart_count}.log"
            with contextlib.suppress(OSError):
                lines = logfile.read_bytes().decode(errors="replace").splitlines()[-80:]
                message = "\n".join(lines)[-2048:]
        return message.strip()

    def _volume(self, vol: Obj) -> Path:
        path = self.dir / "volumes" / vol["name"]
        path.mkdir(parents=True, exist_ok=True)
        if "emptyDir" in vol:
            return path
        if "configMap" in vol:
            self._write_items(path, "ConfigMap", vol["configMap"], vol["configMap"].get("items"))
        elif "secret" in vol:
            src = vol["secret"]
            self._write_items(path, "Secret", {**src, "name": src["secretName"]}, src.get("items"))
        elif "downwardAPI" in vol:
            for item in vol["downwardAPI"].get("items", []):
                self._write_field(path, item)
        elif "projected" in vol:
            for src in vol["projected"].get("sources", []):
                if "serviceAccountToken" in src:
                    sat = src["serviceAccountToken"]
                    (path / sat["path"]).write_text(self._token(sat.get("audience"), sat.get("expirationSeconds")))
                elif "configMap" in src:
                    self._write_items(path, "ConfigMap", src["configMap"], src["configMap"].get("items"))
                elif "secret" in src:
                    self._write_items(path, "Secret", src["secret"], src["secret"].get("items"))
                elif "downwardAPI" in src:
                    for item in src["downwardAPI"].get("items", []):
                        self._write_field(path, item)
                else:
                    raise PodConfigError(f"volumes[{vol['name']}].projected: source {sorted(src)} is not supported")
        else:
            kinds = sorted(k for k in vol if k != "name")
            raise PodConfigError(
                f"volumes[{vol['name']}]: {kinds} volumes are not supported by the node agent "
                "(emptyDir, configMap, secret, downwardAPI and projected are)"
            )
        return path

    def _write_items(self, path: Path, kind: str, ref: Obj, items: list[Obj] | None) -> None:
        data = self.lookup(kind, self.ns, ref["name"])
        if data is None:
            if ref.get("optional"):
                return
            raise PodConfigError(f"volume source {kind} {ref['name']!r} not found")
        pairs = [(i["key"], i["path"]) for i in items] if items else [(k, k) for k in data]
        for key, rel in pairs:
            if key not in data:
                raise PodConfigError(f"volume source {kind} {ref['name']!r} has no key {key!r}")
            target = path / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(data[key])

    def _write_field(self, path: Path, item: Obj) -> None:
        if "fieldRef" not in item:
            raise PodConfigError(f"downwardAPI item {item.get('path')!r}: only fieldRef is supported")
        (path / item["path"]).write_text(podspec.field_ref(self._pod_with_ips(), item["fieldRef"]["fieldPath"]))

    def _token(self, audience: str | None, expiration: int | None) -> str:
        """A bound service-account token through the TokenRequest API, as the kubelet gets it."""
        sa = self.pod["spec"].get("serviceAccountName", "default")
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": [audience] if audience else [],
                "expirationSeconds": int(expiration or 3607),
                "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": self.pod_name, "uid": self.uid},
            },
        }
        out = self.node.client.create(f"/api/v1/namespaces/{self.ns}/serviceaccounts/{sa}/token", body)
        token = str(out["status"]["token"])
        if not audience:
            self._api_token = token
        return token

    def lookup(self, kind: str, ns: str, name: str) -> dict[str, str] | None:
        plural = {"ConfigMap": "configmaps", "Secret": "secrets"}[kind]
        obj = self.node.client.get_or_none(f"/api/v1/namespaces/{ns}/{plural}/{name}")
        if obj is None:
            return None
        if kind == "Secret":
            return {k: base64.b64decode(v).decode("utf-8", "replace") for k, v in (obj.get("data") or {}).items()}
        data = dict(obj.get("data") or {})
        data.update(
            {k: base64.b64decode(v).decode("utf-8", "replace") for k, v in (obj.get("binaryData") or {}).items()}
        )
        return data

    def _pod_with_ips(self) -> Obj:
        pod = json.loads(json.dumps(self.pod))
        pod.setdefault("status", {}).update(
            {
                "podIP": self.ip,
                "podIPs": [{"ip": self.ip}],
                "hostIP": self.node.ip,
                "hostIPs": [{"ip": self.node.ip}],
            }
        )
        return pod

    def _base_env(self, c: Container) -> dict[str, str]:
        cfg = self.node.config
        env = {
            **image_env(cfg, self.root),
            "HOSTNAME": self.pod_name,
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": cfg.server.rsplit(":", 1)[1],
        }
        release = release_source(cfg, c.spec.get("image", ""))
        if release is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(release), env.get("PYTHONPATH")) if p)
        token = self._api_token
        sa_mounted = any(mp.rstrip("/") == SERVICE_ACCOUNT_DIR for mp in self.mounts.get(c.name, {}))
        if token and sa_mounted:
            # In-cluster clients read the fixed path /var/run/secrets/...; ours load this kubeconfig.
            kubeconfig = self.dir / "kubeconfig"
            if not kubeconfig.exists():
                ca = self.dir / "ca.crt"
                shutil.copyfile(cfg.ca, ca)
                write_kubeconfig(kubeconfig, cfg.server, ca, "pod", token=token, namespace=self.ns)
            env["KUBECONFIG"] = str(kubeconfig)
        return env

    # ------------------------------------------------------------------ containers
    def _start(self, c: Container) -> None:
        mounts = self.mounts.get(c.name, {})
        try:
            env = podspec.container_env(self._pod_with_ips(), c.spec, self.lookup, self._base_env(c))
            env = {k: podspec.rewrite_path(v, mounts) for k, v in env.items()}
            argv = podspec.command_line(c.spec, env, mounts, lambda p: shutil.which(p, path=env["PATH"]))
        except (PodConfigError, ApiError) as err:
            c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(err)}}
            c.next_start = time.monotonic() + 1.0
            return
        cwd = Path(podspec.rewrite_path(c.spec["workingDir"], mounts)) if c.spec.get("workingDir") else self.root
        cwd.mkdir(parents=True, exist_ok=True)
        logfile = self.dir / "logs" / f"{c.name}.{c.restart_count}.log"
        fork = self.node.forkserver
        try:
            if fork is not None and fork.module_of(argv, env["PATH"]):
                c.proc = fork.spawn(argv, env, cwd, logfile, new_session=True, die_with_parent=True)
            else:
                with open(logfile, "ab") as out:
                    c.proc = subprocess.Popen(
                        argv,
                        env=env,
                        cwd=cwd,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # the container: its own process group
                        preexec_fn=die_with_parent,
                    )
        except OSError as err:
            c.proc = None
            self._exited(c, 128, f"StartError: {err}", reason="StartError")
            return
        c.started_at = time.monotonic()
        c.killed_by_agent = False
        c.state = {"running": {"startedAt": now_rfc3339()}}
        release = release_source(self.node.config, c.spec.get("image", ""))
        code = f"; the code of release {release.parent.name}" if release is not None else ""
        self.node.event(self.pod, "Started", f"Started container {c.name} (pid {c.proc.pid}{code})")

    def _exited(self, c: Container, code: int, message: str = "", reason: str | None = None) -> None:
        """Records a container's exit and decides whether it will run again."""
        started = c.state.get("running", {}).get("startedAt", now_rfc3339())
        term: Obj = {
            "exitCode": code,
            "reason": reason or ("Completed" if code == 0 else "Error"),
            "startedAt": started,
            "finishedAt": now_rfc3339(),
            "containerID": self._container_id(c),
        }
        message = message or self._termination_message(c, code)
        if message:
            term["message"] = message
        c.state = {"terminated": term}
        if c.proc is not None:
            # When a container's main process ends, the rest of the container goes with it.
            _kill_group(c.proc.pid)
        policy = podspec.restart_policy(self.pod)
        restart = policy == "Always" or (policy == "OnFailure" and code != 0)
        if c.init and code == 0:
            restart = False
        if not restart or self.deleting or self._shutdown_grace is not None:
            c.done = True
            return
        ran = time.monotonic() - c.started_at
        cfg = self.node.config
        c.backoff = cfg.backoff_initial if ran > 60 or not c.backoff else min(c.backoff * 2, cfg.backoff_max)
        c.next_start = time.monotonic() + c.backoff
        c.last_state = {"terminated": term}
        c.state = {
            "waiting": {
                "reason": "CrashLoopBackOff",
                "message": f"back-off {c.backoff:.0f}s restarting failed container={c.name} pod={self.pod_name}",
            }
        }
        self.node.event(self.pod, "BackOff", f"Back-off restarting failed container {c.name}", "Warning")

    def _container_id(self, c: Container) -> str:
        return f"spotrl://{self.uid[:8]}-{c.name}-{c.restart_count}"

    def _poll(self, containers: list[Container]) -> bool:
        """Notices exits and due restarts; returns whether anything changed."""
        changed = False
        for c in containers:
            code = c.proc.poll() if c.proc is not None and "running" in c.state else None
            if code is not None:
                self._exited(c, exit_code(code))
                changed = True
            if c.done or "waiting" not in c.state or time.monotonic() < c.next_start:
                continue
            reason = c.state["waiting"].get("reason")
            if reason == "CrashLoopBackOff":
                c.restart_count += 1
                self._start(c)
                changed = True
            elif reason == "CreateContainerConfigError":
                self._start(c)
                changed = True
        return changed

    def _run_init_containers(self) -> bool:
        """Runs each init container to success; False if the pod failed on one."""
        for c in (c for c in self.containers if c.init):
            self._start(c)
            self._report()
            while not (c.done and "terminated" in c.state):
                self._check()
                if self._poll([c]):
                    self._report()
                self._wait(TICK)
            if c.state["terminated"]["exitCode"] != 0:
                self.phase = "Failed"
                self._report()
                return False
        return True

    def _supervise(self) -> None:
        while not self.terminal:
            self._check()
            if self._poll(self._regular()):
                self._report()
            self._wait(TICK)

    def _adopt_after_reboot(self) -> None:
        """The node came back (the processes are gone): carry the restart counts over, and a
        pod that may not restart fails, as after a kubelet restart on a rebooted machine."""
        statuses = {s["name"]: s for s in self.pod.get("status", {}).get("containerStatuses", []) or []}
        for c in self._regular():
            c.restart_count = int(statuses.get(c.name, {}).get("restartCount", 0))
            if c.name in statuses:
                c.restart_count += 1
        if podspec.restart_policy(self.pod) == "Never" and statuses:
            for c in self._regular():
                c.state = {
                    "terminated": {
                        "exitCode": 137,
                        "reason": "ContainerStatusUnknown",
                        "message": "The container could not be located when the pod was terminated",
                        "finishedAt": now_rfc3339(),
                    }
                }
                c.done = True
            self.phase = "Failed"
            self._report()

    # ------------------------------------------------------------------ termination
    def _terminate(self, grace: float) -> None:
        """preStop hooks, SIGTERM to each main process, wait for the grace period, SIGKILL."""
        deadline = time.monotonic() + max(grace, 0.0)
        running = [c for c in self.containers if c.running]
        self.node.event(self.pod, "Killing", f"Stopping containers {[c.name for c in running]} (grace {grace:.0f}s)")
        hooks = [threading.Thread(target=self._pre_stop, args=(c, deadline), daemon=True) for c in running]
        for h in hooks:
            h.start()
        for h in hooks:
            h.join(max(0.0, deadline - time.monotonic()))
        # The kubelet gives at least 2 s after the hooks for SIGTERM to work.
        deadline = max(deadline, time.monotonic() + 2.0) if grace > 0 else deadline
        for c in running:
            if c.running and c.proc is not None:
                c.killed_by_agent = True
                with contextlib.suppress(ProcessLookupError):
                    os.kill(c.proc.pid, signal.SIGTERM)
        while any(c.running for c in running) and time.monotonic() < deadline and not self._killed.is_set():
            time.sleep(0.05)
        for c in running:
            if c.proc is not None:
                _kill_group(c.proc.pid)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.proc.wait(5)
                self._exited(c, exit_code(c.proc.returncode if c.proc.returncode is not None else -9))
        for c in self.containers:
            c.done = True
            if "waiting" in c.state and "terminated" in c.last_state:
                c.state = c.last_state

    def _pre_stop(self, c: Container, deadline: float) -> None:
        hook = (c.spec.get("lifecycle") or {}).get("preStop") or {}
        try:
            if "exec" in hook:
                mounts = self.mounts.get(c.name, {})
                env = podspec.container_env(self._pod_with_ips(), c.spec, self.lookup, self._base_env(c))
                env = {k: podspec.rewrite_path(v, mounts) for k, v in env.items()}
                argv = [podspec.rewrite_path(podspec.expand(a, env), mounts) for a in hook["exec"]["command"]]
                with open(self.dir / "logs" / f"{c.name}.prestop.log", "ab") as out:
                    subprocess.run(
                        argv,
                        env=env,
                        cwd=self.root,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        timeout=max(0.1, deadline - time.monotonic()),
                        check=False,
                    )
            elif "sleep" in hook:
                time.sleep(min(float(hook["sleep"]["seconds"]), max(0.0, deadline - time.monotonic())))
        except (subprocess.TimeoutExpired, OSError, PodConfigError, ApiError) as err:
            self.node.event(self.pod, "FailedPreStopHook", f"preStop hook of {c.name} failed: {err}", "Warning")

    def _finish_phase_after_kill(self) -> None:
        if self.terminal:
            return
        codes = [c.state.get("terminated", {}).get("exitCode", 137) for c in self._regular()]
        self.phase = "Succeeded" if all(code == 0 for code in codes) else "Failed"

    def _finalize(self) -> None:
        """The containers are gone: remove the pod object, as the kubelet does (grace 0)."""
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}}
        try:
            self.node.client.delete(f"/api/v1/namespaces/{self.ns}/pods/{self.pod_name}", body)
        except ApiError as err:
            if err.status != 409:  # 409: a newer pod of that name; ours is gone already
                raise

    def _kill_all(self) -> None:
        for c in self.containers:
            if c.proc is not None and c.proc.poll() is None:
                _kill_group(c.proc.pid)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.proc.wait(5)

    # ------------------------------------------------------------------ status
    def _compute_phase(self) -> str:
        if self.terminal:
            return self.phase
        inits = [c for c in self.containers if c.init]
        if any(not (c.done and c.state.get("terminated", {}).get("exitCode") == 0) for c in inits):
            return "Pending"
        regular = self._regular()
        if all(c.done for c in regular):
            ok = all(c.state.get("terminated", {}).get("exitCode") == 0 for c in regular)
            return "Succeeded" if ok else "Failed"
        if any("running" in c.state or "terminated" in c.last_state or c.done for c in regular):
            return "Running"
        return "Pending"

    def _container_status(self, c: Container) -> Obj:
        ready = "running" in c.state and not self.deleting
        status: Obj = {
            "name": c.name,
            "image": c.spec.get("image", ""),
            "imageID": "spotrl://local-python",
            "ready": ready and not c.init,
            "started": "running" in c.state,
            "restartCount": c.restart_count,
            "state": c.state,
            "lastState": c.last_state,
        }
        if "waiting" not in c.state:
            status["containerID"] = self._container_id(c)
        if c.init:
            status["ready"] = "terminated" in c.state and c.state["terminated"]["exitCode"] == 0
        return status

    def _report(self) -> None:
        """Patches pods/status when it differs from what was last sent."""
        if self._killed.is_set():
            raise _NodeLostError
        with self._lock:
            pod = self.pod
        self.phase = self._compute_phase()
        regular = self._regular()
        inits_done = all(
            c.done and c.state.get("terminated", {}).get("exitCode") == 0 for c in self.containers if c.init
        )
        all_ready = bool(regular) and all("running" in c.state for c in regular) and not self.terminal

        def cond(kind: str, ok: bool, reason: str | None = None) -> Obj:
            out: Obj = {"type": kind, "status": "True" if ok else "False"}
            if reason and not ok:
                out["reason"] = reason
            return out

        conditions = [
            cond("PodReadyToStartContainers", bool(self.ip) and not self.terminal),
            cond("Initialized", inits_done, "ContainersNotInitialized"),
            cond("ContainersReady", all_ready, "ContainersNotReady"),
            cond("Ready", all_ready, "ContainersNotReady"),
        ]
        if self.disruption:
            conditions.append(self.disruption)
        status: Obj = {
            "phase": self.phase,
            "conditions": conditions,
            "hostIP": self.node.ip,
            "hostIPs": [{"ip": self.node.ip}],
            "startTime": self.start_time,
            "containerStatuses": [self._container_status(c) for c in regular],
        }
        if self.ip:
            status["podIP"] = self.ip
            status["podIPs"] = [{"ip": self.ip}]
        if any(c.init for c in self.containers):
            status["initContainerStatuses"] = [self._container_status(c) for c in self.containers if c.init]
        if self.reason:
            status["reason"] = self.reason
        if self.message:
            status["message"] = self.message
        text = json.dumps(status, sort_keys=True)
        if text == self._last_status:
            return
        old = {c["type"]: c for c in (pod.get("status") or {}).get("conditions", []) or []}
        for c in conditions:
            prev = old.get(c["type"])
            keep = prev is not None and prev.get("status") == c["status"] and prev.get("lastTransitionTime")
            c.setdefault("lastTransitionTime", prev["lastTransitionTime"] if keep and prev else now_rfc3339())
        patch = {"metadata": {"uid": self.uid}, "status": status}
        try:
            updated = self.node.client.patch(
                f"/api/v1/namespaces/{self.ns}/pods/{self.pod_name}/status", patch, STRATEGIC
            )
        except ApiError as err:
            if err.status in (404, 409, 422):
                log.info("pod %s/%s: status not written: %s", self.ns, self.pod_name, err)
                return
            raise
        self._last_status = text
        with self._lock:
            if updated.get("metadata", {}).get("uid") == self.uid:
                self.pod = {**updated, "metadata": {**updated["metadata"], **_deletion_fields(self.pod)}}

    def describe(self) -> Obj:
        """What the control channel shows about this pod."""
        return {
            "namespace": self.ns,
            "name": self.pod_name,
            "uid": self.uid,
            "ip": self.ip,
            "phase": self.phase,
            "dir": str(self.dir),
            "containers": {c.name: {"pid": c.proc.pid if c.proc else None, "state": c.state} for c in self.containers},
        }


def _deletion_fields(pod: Obj) -> Obj:
    meta = pod.get("metadata", {})
    return {k: meta[k] for k in ("deletionTimestamp", "deletionGracePeriodSeconds") if k in meta}


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


class _NodeLostError(Exception):
    """The node was lost: stop without a word to the API server."""


class _PodDeletedError(Exception):
    """The pod is gone; the worker ends."""


class _PodTerminalError(Exception):
    """The pod reached a terminal phase from outside (node shutdown)."""
