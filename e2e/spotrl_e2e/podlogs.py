"""Keeps the log of every container of the SpotRL pods of a cluster, as it is written.

Why: ``kind export logs`` (``e2e/kind/run.sh``, on failure) only finds what is still on the
nodes. A pod that a test force-deletes (the leading operator), or that the operator replaces
after a crash (a controller), takes its logs with it. :class:`PodLogKeeper` follows each
container from the moment it runs, so the file stays however the pod ends.

How: a thread lists the pods (``kubectl get pods -A -l SELECTOR -o json``) every second and,
for each container instance it has not seen yet that runs or has ended, starts
``kubectl logs -f --timestamps``; the follower ends by itself when the container does (or its
pod is deleted). For a container that restarted it also grabs ``--previous`` once: the
instance before may have lived between two looks.

Layout, under the output folder::

    <namespace>/<pod>/<container>.log                the first instance (restart count 0)
    <namespace>/<pod>/<container>.restart-<n>.log    the instance after n restarts
    <namespace>/<pod>/<container>.previous-<n>.log   ``--previous`` when the count was n
    keeper.log                                       the keeper's own errors

Files are appended to, each follower's output after a ``# spotrl pod-logs:`` line: a pod
recreated under the same name, or a second pytest session on the same cluster, adds to the
file rather than replacing what may no longer be on the node.

The default selector, ``app.kubernetes.io/name=spotrl``, is on the chart's operator pods
(``spotrl.selectorLabels``, the chart's name) and on every pod the operator makes
(``spotrl_operator.resources.instance_labels``).
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import threading
import time
from collections.abc import Iterator, Set
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from spotrl_e2e.procs import die_with_parent

Obj = dict[str, Any]

DEFAULT_SELECTOR = "app.kubernetes.io/name=spotrl"
# A follower that fails (API server or kubelet unreachable) while its container is still
# listed is started again on a later look, this many times at most: a pod left listed on a
# lost node would otherwise start one kubectl a second.
MAX_RETRIES = 3

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_MAX_PART = 200  # below the 255 bytes of a file name, with room for the suffixes


@dataclass(frozen=True)
class LogTask:
    """One ``kubectl logs`` to run once: the follower of a container instance, or the grab of
    the instance before it (``previous``). ``key`` says what "once" means."""

    key: str
    namespace: str
    pod: str
    container: str
    restarts: int
    previous: bool = False


# ----------------------------------------------------------------------------- pure parts


def safe_name(name: str) -> str:
    """One path component: API names are DNS labels, but the files must stay under the output
    folder whatever a name holds (a slash, ``..``, nothing)."""
    part = _UNSAFE.sub("_", name)[:_MAX_PART]
    return part if part.strip(".") else f"_{part}"


def log_path(out: Path, task: LogTask) -> Path:
    """Where a task's output goes (the layout in the module's docstring)."""
    if task.previous:
        stem = f"{task.container}.previous-{task.restarts}"
    elif task.restarts:
        stem = f"{task.container}.restart-{task.restarts}"
    else:
        stem = task.container
    return out / safe_name(task.namespace) / safe_name(task.pod) / f"{safe_name(stem)}.log"


def container_statuses(pod: Obj) -> list[Obj]:
    """Every container's status, init containers first (their logs explain a pod that never
    got further)."""
    status = pod.get("status") or {}
    return [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]


def tasks_for(pod: Obj, started: Set[str]) -> list[LogTask]:
    """The ``kubectl logs`` to start for a pod, given the keys of those already started."""
    meta = pod.get("metadata") or {}
    namespace, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
    # The uid, not the name: a pod recreated under the same name is another pod.
    uid = str(meta.get("uid") or f"{namespace}/{name}")
    tasks = (t for s in container_statuses(pod) for t in _container_tasks(namespace, name, uid, s))
    return [t for t in tasks if t.key not in started]


def _container_tasks(namespace: str, pod: str, uid: str, status: Obj) -> Iterator[LogTask]:
    container = str(status.get("name", ""))
    restarts = int(status.get("restartCount") or 0)
    state = status.get("state") or {}
    # Only a container that runs or ran has a log; a waiting one is looked at again later.
    if "running" in state or "terminated" in state:
        # The container ID tells instances apart; the restart count when the runtime gave none.
        instance = status.get("containerID") or (state.get("terminated") or {}).get("containerID")
        yield LogTask(f"{uid}/{container}/{instance or f'restart-{restarts}'}", namespace, pod, container, restarts)
    last = (status.get("lastState") or {}).get("terminated")
    if restarts and last:
        # Once per instance that ended: its follower may never have started (it lived between
        # two looks) or lost its stream; kubectl keeps only this one previous instance.
        instance = last.get("containerID") or f"restart-{restarts}"
        yield LogTask(f"{uid}/{container}/previous/{instance}", namespace, pod, container, restarts, previous=True)


def logs_argv(kubectl: Path, kubeconfig: Path, task: LogTask) -> list[str]:
    mode = "--previous" if task.previous else "--follow"
    return [
        str(kubectl),
        f"--kubeconfig={kubeconfig}",
        "logs",
        f"--namespace={task.namespace}",
        task.pod,
        f"--container={task.container}",
        "--timestamps",
        mode,
    ]


# ----------------------------------------------------------------------------- the keeper


@dataclass
class _Follower:
    task: LogTask
    proc: subprocess.Popen[bytes]


class PodLogKeeper:
    """Follows the logs of every pod matching ``selector`` in all namespaces into ``out``
    until :meth:`stop`. Every subprocess is started and ended by its one thread."""

    def __init__(
        self,
        kubeconfig: Path,
        kubectl: Path,
        out: Path,
        selector: str = DEFAULT_SELECTOR,
        interval: float = 1.0,
    ):
        self.kubeconfig = kubeconfig
        self.kubectl = kubectl
        self.out = out
        self.selector = selector
        self.interval = interval
        self._started: set[str] = set()
        self._retries: dict[str, int] = {}
        self._followers: list[_Follower] = []
        self._last_error = ""
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pod-logs", daemon=True)

    def start(self) -> PodLogKeeper:
        self.out.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 60) -> None:
        """Ends the poller after a last look, then every follower still running."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def __enter__(self) -> PodLogKeeper:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._look()
                self._stopping.wait(self.interval)
            self._look()  # what ended since the last look
        finally:
            self._end_followers()

    def _look(self) -> None:
        # Nothing may end the thread early: the followers' logs are the point.
        try:
            self.sync()
        except Exception as err:
            self._note(f"looking at the pods: {err!r}")

    def sync(self) -> None:
        """One look: reap the followers that ended, start what the pods now need."""
        self._reap()
        try:
            pods = self._list_pods()
        except (OSError, subprocess.SubprocessError, RuntimeError, ValueError) as err:
            self._note(f"listing pods: {err}")
            return
        for pod in pods:
            for task in tasks_for(pod, self._started):
                self._start(task)

    def _list_pods(self) -> list[Obj]:
        argv = [str(self.kubectl), f"--kubeconfig={self.kubeconfig}", "get", "pods", "--all-namespaces"]
        argv += [f"--selector={self.selector}", "--output=json", "--request-timeout=20s"]
        # stdin closed: kubectl prompts for a user name on a kubeconfig without credentials.
        out = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"kubectl get pods exited {out.returncode}: {out.stderr.strip()}")
        return list(json.loads(out.stdout).get("items") or [])

    def _start(self, task: LogTask) -> None:
        self._started.add(task.key)
        path = log_path(self.out, task)
        argv = logs_argv(self.kubectl, self.kubeconfig, task)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "ab") as log:
                log.write(f"# spotrl pod-logs: {_now()} {' '.join(argv[2:])} ({task.key})\n".encode())
                log.flush()
                # Its own session: a ^C to pytest must not end it before the tests' teardown has
                # been logged; it dies with this thread if the test process is killed.
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=die_with_parent,
                )
        except OSError as err:
            self._note(f"{task.key}: {err}")
            return
        self._followers.append(_Follower(task, proc))

    def _reap(self) -> None:
        """Forgets the followers that ended; one that failed may be started again (a stream
        broken while its container still runs) while it is still listed."""
        running = []
        for f in self._followers:
            code = f.proc.poll()
            if code is None:
                running.append(f)
            elif code != 0 and not f.task.previous and self._retries.get(f.task.key, 0) < MAX_RETRIES:
                self._retries[f.task.key] = self._retries.get(f.task.key, 0) + 1
                self._started.discard(f.task.key)
        self._followers = running

    def _end_followers(self, grace: float = 1.0) -> None:
        """A moment for the last look's followers of ended containers to finish, then SIGTERM
        (SIGKILL if ignored) to the rest, which follow containers still running."""
        deadline = time.monotonic() + grace
        while any(f.proc.poll() is None for f in self._followers) and time.monotonic() < deadline:
            time.sleep(0.05)
        for f in self._followers:
            if f.proc.poll() is None:
                f.proc.terminate()
        for f in self._followers:
            try:
                f.proc.wait(5)
            except subprocess.TimeoutExpired:
                f.proc.kill()
                f.proc.wait(5)
        self._followers = []

    def _note(self, message: str) -> None:
        """The keeper's own errors, in keeper.log; a repeated one once (the poll runs every second)."""
        if message == self._last_error:
            return
        self._last_error = message
        with contextlib.suppress(OSError), open(self.out / "keeper.log", "a") as log:
            log.write(f"{_now()} {message}\n")


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
