"""Generation workers as Ray actors, and the dispatcher that feeds them group requests.

The controller hands groups to :meth:`GenerationPool.submit` and collects one outcome per
dispatched group from :meth:`GenerationPool.poll`, as the groups complete:

- :class:`GroupGenerated`: all ``n`` samples, stamped with the weight version and worker;
- :class:`GroupFailed`: the backend raised for this group (retry it or drop it);
- :class:`GroupLost`: its worker died first (``ray.kill``, a crash, a lost node or worker
  pod). Redispatch it with the same ``group_id``; nothing else needs restoring. The dead
  worker is replaced (up to ``max_restarts`` times each) and the replacement loads the
  newest weights first.

Workers may come up late: an actor whose node has not joined yet (``generation.workerPods``:
its pod is still starting) is simply pending. A worker gets groups only once it answered
its first probe (its backend is built), so groups never wait behind a worker that is not
there; :meth:`GenerationPool.wait_ready` waits for as many workers as the caller needs.

Weight sync (:meth:`GenerationPool.update_weights`): the state dict is put in the Ray object
store once and every live worker loads it from there. Ray runs one caller's calls to an actor
in order, so the load lands between the generate calls sent before it and those sent after,
and each result records the version it was generated with.

Not thread-safe for concurrent callers beyond a lock around its bookkeeping: call it from the
controller's loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from spotrl_runtime.generation.backend import BackendSpec
from spotrl_runtime.generation.types import GenerationRequest, GroupFailed, GroupLost, GroupOutcome
from spotrl_runtime.generation.worker import GenerationWorker

if TYPE_CHECKING:
    import torch

log = logging.getLogger("spotrl.generation")

WEIGHT_PUT_BYTES = 64 << 20
"""Weights go to Ray's object store in parts of about this size (split as a cut splits them,
:func:`~spotrl_runtime.checkpoint.trainer_state.weight_parts`), so that sending them can stop
between two parts (a barrier needs the CPUs and memory bandwidth more)."""
WEIGHT_PUT_MAX_PARTS = 1024


class GenerationPoolError(RuntimeError):
    """The pool can make no progress (every worker is dead and may not be restarted)."""


@dataclass
class _Call:
    kind: Literal["generate", "load", "probe"]
    worker_id: str
    group_ids: tuple[str, ...] = ()
    version: int = 0


@dataclass
class _Worker:
    worker_id: str
    actor: Any
    alive: bool = True
    ready: bool = False
    """The actor answered its probe: its backend is built and it takes groups."""
    start_failures: int = 0
    """Starts in a row whose constructor raised (reset by a probe that answers)."""
    weight_version: int = 0
    restarts: int = 0
    generated: int = 0
    lost: int = 0
    calls: set[Any] = field(default_factory=set)
    """ObjectRefs of this worker's calls in flight."""
    last_error: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    """What the worker's probe answered (host, pid ...)."""


def _is_worker_process(pid: int) -> bool:
    """Whether ``pid`` here is a generation worker's process (Ray names an actor's process
    ``ray::<class>``)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f"ray::{GenerationWorker.__name__}".encode() in f.read()
    except OSError:
        return False


class GenerationPool:
    """``num_workers`` :class:`GenerationWorker` actors, fed with group requests in FIFO order."""

    def __init__(
        self,
        spec: BackendSpec,
        num_workers: int,
        *,
        groups_per_call: int = 8,
        calls_per_worker: int = 2,
        max_restarts: int | None = 3,
        max_start_failures: int = 3,
        actor_options: Mapping[str, Any] | None = None,
        name: str = "gen",
    ) -> None:
        """``groups_per_call`` groups travel in one actor call (vLLM batches them together);
        ``calls_per_worker`` calls may be queued at a worker so it never idles between them;
        ``max_restarts``: replacements of each worker (None: no limit, for workers whose pods
        come and go), but a worker whose actor fails to start ``max_start_failures`` times in
        a row is given up; ``actor_options`` go to ``ray.remote(...).options`` (default: 1 GPU
        for vLLM on CUDA, 1 CPU else; e.g. a custom resource that only worker nodes offer)."""
        import ray

        if num_workers < 1:
            raise ValueError("generation.workers must be >= 1")
        if not ray.is_initialized():
            raise GenerationPoolError("Ray is not initialised; call ray.init() (or connect to the cluster) first")
        self.spec = spec
        self.groups_per_call = max(1, groups_per_call)
        self.calls_per_worker = max(1, calls_per_worker)
        self.max_restarts = max_restarts
        self.max_start_failures = max(1, max_start_failures)
        on_gpu = spec.kind == "vllm" and spec.device.startswith("cuda")
        default_options: dict[str, Any] = {"num_gpus": 1} if on_gpu else {"num_cpus": 1}
        self._actor_options = {**default_options, "max_restarts": 0, **(actor_options or {})}
        self._actor_class = ray.remote(GenerationWorker)
        self._name = name
        self._lock = threading.RLock()
        self._queue: deque[GenerationRequest] = deque()
        self._calls: dict[Any, _Call] = {}
        self._assigned: dict[str, str] = {}
        self._outbox: list[GroupOutcome] = []
        self._latest_weights: tuple[Any, int] | None = None
        self._workers: dict[str, _Worker] = {}
        self._frozen = False
        """:meth:`freeze` was called: nothing more is sent to a worker."""
        self._paused: list[int] = []
        """Pids of the workers :meth:`freeze` paused, for :meth:`shutdown` to kill."""
        with self._lock:
            for i in range(num_workers):
                worker = _Worker(f"{name}-{i}", None)
                self._workers[worker.worker_id] = worker
                self._launch(worker)

    # ------------------------------------------------------------------ requests

    def submit(self, requests: Iterable[GenerationRequest]) -> None:
        """Queues groups for generation. A group id already queued or in flight is an error, and
        then none of ``requests`` is queued."""
        batch = list(requests)
        with self._lock:
            seen = {r.group_id for r in self._queue} | set(self._assigned)
            for request in batch:
                if request.group_id in seen:
                    raise ValueError(f"group {request.group_id} is already queued or in flight")
                seen.add(request.group_id)
            self._queue.extend(batch)
            self._dispatch()

    def poll(self, timeout: float | None = 0.0) -> list[GroupOutcome]:
        """Outcomes of the groups that completed, waiting up to ``timeout`` seconds (None: until
        at least one completes) when none is ready. Returns [] when nothing is in flight."""
        import ray

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if self._outbox:
                    out, self._outbox = self._outbox, []
                    return out
                refs = list(self._calls)
            if not refs:
                self._raise_if_all_dead()
                return []
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(refs, num_returns=1, timeout=remaining)
            if ready:
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                with self._lock:
                    for ref in ready:
                        self._complete(ref)
                    self._dispatch()
            elif deadline is not None and time.monotonic() >= deadline:
                return []

    # ------------------------------------------------------------------ weights

    def update_weights(
        self,
        state_dict: Mapping[str, torch.Tensor],
        version: int,
        *,
        wait: bool = True,
        cancelled: Callable[[], bool] | None = None,
    ) -> bool:
        """Sends new policy weights to every live worker (``ray.put`` in parts of about
        :data:`WEIGHT_PUT_BYTES`, each worker loads them all).

        Groups already sent to a worker are generated with the old weights; groups sent after this
        call with the new ones. ``wait=True`` returns once every ready worker has loaded them
        (which includes finishing what was queued before; a worker still starting loads them
        before its first group); outcomes that complete meanwhile are kept for the next
        :meth:`poll`. ``cancelled`` is asked between parts: once it says yes (a barrier: the
        weights will never be used), nothing is sent and False is returned.
        """
        import ray

        from spotrl_runtime.checkpoint.trainer_state import weight_parts

        refs = []
        for part in weight_parts(state_dict, WEIGHT_PUT_BYTES, WEIGHT_PUT_MAX_PARTS):
            if cancelled is not None and cancelled():
                return False
            refs.append(ray.put(part))
        with self._lock:
            self._latest_weights = (tuple(refs), version)
            # A worker still starting loads them too, before any group (its calls run in order).
            load_refs = [(w.ready, self._send_load(w)) for w in self._workers.values() if w.alive]
        if wait:
            pending = [r for ready, r in load_refs if ready and r is not None]
            while pending:
                ready, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
                with self._lock:
                    for r in ready:
                        self._complete(r)
                    self._dispatch()
        return True

    # ------------------------------------------------------------------ introspection

    def wait_ready(
        self, timeout: float = 300.0, min_ready: int | None = None, stop: threading.Event | None = None
    ) -> None:
        """Blocks until ``min_ready`` workers (default: every live one) have built their backend,
        or ``stop`` is set. Raises :class:`GenerationPoolError` when they have not within
        ``timeout`` seconds, or when every worker is dead and out of restarts."""
        import ray

        deadline = time.monotonic() + timeout
        while stop is None or not stop.is_set():
            with self._lock:
                live = [w for w in self._workers.values() if w.alive]
                ready = [w for w in live if w.ready]
                need = len(live) if min_ready is None else min_ready
                probes = [ref for ref, call in self._calls.items() if call.kind == "probe"]
            self._raise_if_all_dead()
            if len(ready) >= max(1, need):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                waiting = ", ".join(w.worker_id for w in live if not w.ready)
                raise GenerationPoolError(
                    f"{len(ready)} of {len(self._workers)} generation workers started within {timeout:.0f} s "
                    f"({need} needed; still starting: {waiting or 'none'}); the workers' nodes may not have "
                    "joined the Ray cluster, or their resources are not there"
                )
            if not probes:
                time.sleep(min(left, 0.1))
                continue
            done, _ = ray.wait(probes, num_returns=1, timeout=min(left, 1.0))
            with self._lock:
                for ref in done:
                    self._complete(ref)
                self._dispatch()

    def assignments(self) -> dict[str, str]:
        """group_id → worker_id of every group in flight."""
        with self._lock:
            return dict(self._assigned)

    def in_flight(self) -> int:
        """Groups sent to workers and not yet reported."""
        with self._lock:
            return len(self._assigned)

    def calls_in_flight(self) -> int:
        """Actor calls (probes, weight loads, generate calls) not yet answered: with none,
        :meth:`poll` has nothing to wait on and returns at once."""
        with self._lock:
            return len(self._calls)

    def queued(self) -> int:
        """Groups waiting for a free worker."""
        with self._lock:
            return len(self._queue)

    def workers(self) -> list[dict[str, Any]]:
        """Per worker: id, alive, ready, host, pid, paused (:meth:`freeze`), confirmed weight
        version, restarts, groups generated and lost."""
        with self._lock:
            return [
                {
                    "worker": w.worker_id,
                    "alive": w.alive,
                    "ready": w.ready,
                    "host": w.info.get("host"),
                    "node_ip": w.info.get("node_ip"),
                    "pid": w.info.get("pid"),
                    "paused": w.info.get("pid") in self._paused,
                    "weight_version": w.weight_version,
                    "restarts": w.restarts,
                    "generated": w.generated,
                    "lost": w.lost,
                    "in_flight": sum(1 for g in self._assigned.values() if g == w.worker_id),
                    "last_error": w.last_error,
                }
                for w in self._workers.values()
            ]

    def actor(self, worker_id: str) -> Any:
        """The Ray actor handle of a worker (to inspect it, or to kill it in a test)."""
        with self._lock:
            return self._workers[worker_id].actor

    def freeze(self) -> list[int]:
        """Takes the workers' CPU away at once, for a barrier's writer: a worker in this process's
        host (its pid namespace) is paused (SIGSTOP), not killed: a kill would have it, and Ray,
        tear down its gigabytes beside the writer. Nothing is sent to any worker from now on;
        :meth:`shutdown` ends them. Returns the pids paused."""
        with self._lock:
            self._frozen = True
            self._queue.clear()
            host = socket.gethostname()
            for w in self._workers.values():
                pid = w.info.get("pid")
                if w.alive and w.info.get("host") == host and isinstance(pid, int) and pid not in self._paused:
                    if not _is_worker_process(pid):
                        continue  # the same host name, another pid namespace: not ours to stop
                    try:
                        os.kill(pid, signal.SIGSTOP)
                    except ProcessLookupError:
                        continue
                    self._paused.append(pid)
            return list(self._paused)

    def shutdown(self) -> None:
        """Kills every worker actor (a paused one at once, with SIGKILL). Groups in flight are
        abandoned (not reported)."""
        import ray

        with self._lock:
            for pid in self._paused:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self._paused.clear()
            for w in self._workers.values():
                if w.alive:
                    ray.kill(w.actor, no_restart=True)
                w.alive = False
            self._calls.clear()
            self._assigned.clear()
            self._queue.clear()

    # ------------------------------------------------------------------ internals (lock held)

    def _launch(self, worker: _Worker) -> None:
        """Starts the worker's actor and probes it: it takes groups once the probe answers."""
        worker.actor = self._actor_class.options(**self._actor_options).remote(self.spec, worker.worker_id)
        worker.alive = True
        worker.ready = False
        worker.weight_version = 0
        probe = worker.actor.info.remote()
        self._calls[probe] = _Call("probe", worker.worker_id)
        worker.calls.add(probe)

    def _dispatch(self) -> None:
        if self._frozen:
            return
        live = [w for w in self._workers.values() if w.alive and w.ready]
        while self._queue and live:
            worker = min(live, key=lambda w: len(w.calls))
            if len(worker.calls) >= self.calls_per_worker:
                return
            batch = [self._queue.popleft() for _ in range(min(self.groups_per_call, len(self._queue)))]
            ref = worker.actor.generate.remote(batch)
            group_ids = tuple(r.group_id for r in batch)
            self._calls[ref] = _Call("generate", worker.worker_id, group_ids)
            worker.calls.add(ref)
            for gid in group_ids:
                self._assigned[gid] = worker.worker_id

    def _send_load(self, worker: _Worker) -> Any:
        if self._latest_weights is None or self._frozen:
            return None
        refs, version = self._latest_weights
        call_ref = worker.actor.load_weights.remote(version, *refs)
        self._calls[call_ref] = _Call("load", worker.worker_id, version=version)
        worker.calls.add(call_ref)
        return call_ref

    def _complete(self, ref: Any) -> None:
        import ray

        call = self._calls.get(ref)
        if call is None:
            return  # already settled when its worker was declared lost
        worker = self._workers[call.worker_id]
        try:
            value = ray.get(ref)
        except ray.exceptions.RayActorError as err:
            if call.kind == "probe":
                # Its constructor raised (a node that went away while it started is no fault of it).
                worker.start_failures += 1 if err.actor_init_failed else 0
                self._worker_lost(worker, f"failed to start: {err}")
            else:
                self._worker_lost(worker, f"{type(err).__name__}: {err}")
            return
        except Exception as err:
            self._settle(ref)
            if call.kind == "generate":
                self._outbox.extend(
                    GroupFailed(gid, f"{type(err).__name__}: {err}", worker.worker_id) for gid in call.group_ids
                )
            else:
                worker.last_error = f"{'load_weights' if call.kind == 'load' else 'info'} failed: {err}"
                self._worker_lost(worker, worker.last_error)
            return
        self._settle(ref)
        if call.kind == "probe":
            worker.ready = True
            worker.start_failures = 0
            worker.info = dict(value)
            log.info(
                "generation worker %s is up on node %s (%s backend, pid %s, restarts %d)",
                worker.worker_id,
                worker.info.get("node_ip") or worker.info.get("host"),
                worker.info.get("kind"),
                worker.info.get("pid"),
                worker.restarts,
            )
            return
        if call.kind == "load":
            worker.weight_version = int(value)
            return
        for outcome in value:
            if hasattr(outcome, "samples"):
                worker.generated += 1
            self._outbox.append(outcome)

    def _settle(self, ref: Any) -> None:
        call = self._calls.pop(ref)
        self._workers[call.worker_id].calls.discard(ref)
        for gid in call.group_ids:
            self._assigned.pop(gid, None)

    def _worker_lost(self, worker: _Worker, reason: str) -> None:
        """Every group the worker held comes back as lost; the worker is replaced if allowed."""
        import ray

        if not worker.alive:
            return
        worker.alive = False
        worker.last_error = reason
        for ref in list(worker.calls):
            call = self._calls[ref]
            self._settle(ref)
            if call.kind == "generate":
                worker.lost += len(call.group_ids)
                self._outbox.extend(GroupLost(gid, worker.worker_id, reason) for gid in call.group_ids)
        worker.ready = False
        ray.kill(worker.actor, no_restart=True)
        restarts_left = self.max_restarts is None or worker.restarts < self.max_restarts
        again = restarts_left and worker.start_failures < self.max_start_failures
        log.warning(
            "generation worker %s lost (%s); its groups go back for redispatch; %s",
            worker.worker_id,
            reason.splitlines()[0][:300],
            "starting it again" if again else "out of restarts",
        )
        if again:
            self._launch(worker)
            worker.restarts += 1
            self._send_load(worker)

    def _raise_if_all_dead(self) -> None:
        with self._lock:
            if self._workers and not any(w.alive for w in self._workers.values()):
                reasons = "; ".join(f"{w.worker_id}: {w.last_error}" for w in self._workers.values())
                raise GenerationPoolError(f"every generation worker is dead and out of restarts ({reasons})")
