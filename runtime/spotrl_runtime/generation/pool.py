"""Generation workers as Ray actors, and the dispatcher that feeds them group requests.

The controller hands groups to :meth:`GenerationPool.submit` and collects one outcome per
dispatched group from :meth:`GenerationPool.poll`, as the groups complete:

- :class:`GroupGenerated`: all ``n`` samples, stamped with the weight version and worker;
- :class:`GroupFailed`: the backend raised for this group (retry it or drop it);
- :class:`GroupLost`: its worker died first (``ray.kill``, a crash, a lost node or worker
  pod). Redispatch it with the same ``group_id``; nothing else needs restoring. The dead
  worker is replaced (up to ``max_restarts`` times each) and the replacement loads the
  newest weights first;
- :class:`TurnsFinished` (not an outcome: its group goes on): an episode of a multi-turn group
  finished a turn, which the ledger keeps.

Each worker is fed up to a budget (``max_in_flight_groups``, else by its KV cache): the groups
sent to it are all generating at once in its engine, and each comes back as it finishes (the
worker's ``collect``, one call of which is always in flight at a worker that holds groups).

Workers may come up late: an actor whose node has not joined yet (``generation.workerPods``:
its pod is still starting) is simply pending. A worker gets groups only once it answered
its first probe (its backend is built), so groups never wait behind a worker that is not
there; :meth:`GenerationPool.wait_ready` waits for as many workers as the caller needs.

Weight sync (:meth:`GenerationPool.give`, then :meth:`GenerationPool.sync`): the pool orders
versions and requests; the bytes go from the trainer to the workers over the weight channel
(:mod:`~spotrl_runtime.generation.weights`), never through the pool. **Each group is generated
by exactly the version it asks for** (``GenerationRequest.weight_version``, its admission
version):

- a new version joins the queue behind the requests already in it, and is opened (every ready
  worker is sent a receive, and the sender sends) only when it reaches the head and its sender
  waits for it. A worker takes its submits and receives in the order of their sequence numbers,
  and a receive waits for the groups submitted before it to finish, so a receive never
  overtakes a request submitted before it;
- a request for a version the pool has not been given yet is held until it is, and one for a
  version still queued goes in front of the next version's load;
- versions are given in increasing order. A request whose version was already replaced on the
  workers (a group redispatched after its worker died) is generated with the current one;
- a yielding request (``GenerationRequest.yields``: a validation pass) does not hold a load up
  where another worker can load it. A pass runs on one worker; when the load's sender waits,
  the pass's requests still queued go to that worker at once, and it is left out of the sync:
  it is *behind*, finishes its groups on the weights they ask for, takes no new one, and once
  it holds none is a joiner. With one worker (or every worker holding yielding groups) one
  worker still loads the version after its groups: the requests for it need a worker holding it.

A worker that starts or restarts after the first version was opened, or whose receive failed
(its weights are torn), gets no group until :meth:`GenerationPool.sync_joiners` gives it the
trainer's current weights. A member lost during a sync fails the sync within the channel's
timeout, never hangs it: its groups come back lost, and the next sync forms the channel anew.

Each result records the version it was actually generated with, so a caller can check the rule.

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

from spotrl_runtime.core.step_stats import BusyClock
from spotrl_runtime.generation.backend import BackendSpec
from spotrl_runtime.generation.sync_lifecycle import Phase, SenderSync
from spotrl_runtime.generation.types import (
    GenerationRequest,
    GroupFailed,
    GroupLost,
    TurnsFinished,
    WorkerReport,
)
from spotrl_runtime.generation.worker import GenerationWorker

if TYPE_CHECKING:
    from spotrl_runtime.generation.weights import ChannelWatch

log = logging.getLogger("spotrl.generation")

_JOINERS_WAIT = "joiners"
MAX_FAILED_SYNCS = 2
"""Receives in a row a live worker may fail before it is replaced."""
DEFAULT_IN_FLIGHT_GROUPS = 16
"""Groups in flight per worker when neither ``max_in_flight_groups`` nor a KV cache size says."""
KV_OVERCOMMIT = 2
"""A vLLM worker is fed groups whose sequences need up to this many times its KV cache: the
engine's scheduler admits what fits and refills from the rest as sequences finish."""
MAX_ORDERED_CALLS = 4
"""Ordered calls (submits, receives) sent to a worker and not yet answered, at most: each
waits in a thread of the actor (:data:`ACTOR_THREADS`) for the one before it."""
ACTOR_THREADS = MAX_ORDERED_CALLS + 4
"""The worker actor's threads: the ordered calls, its ``collect``, an ``abort`` and a probe."""
COLLECT_WAIT = 1.0
"""Seconds a worker's ``collect`` waits for an outcome before it answers empty."""


class GenerationPoolError(RuntimeError):
    """The pool can make no progress (every worker is dead and may not be restarted)."""


@dataclass
class _Call:
    kind: Literal["submit", "collect", "load", "probe", "abort"]
    worker_id: str
    group_ids: tuple[str, ...] = ()
    version: int = 0


@dataclass(frozen=True)
class _Load:
    """A weight version waiting in the queue for its turn (and its sender)."""

    version: int


@dataclass(frozen=True)
class _Opened:
    """A version sent receives to its members: the sender sends it to them now."""

    version: int
    epoch: int
    members: tuple[str, ...]
    refs: tuple[Any, ...]
    before: tuple[frozenset[str], ...] = ()
    """Per member, the groups it held when its receive was sent: it drains them first."""


@dataclass(frozen=True)
class SyncResult:
    """One sync, as the trainer reports it: ``weight_sync_seconds`` and ``weight_sync_bytes``."""

    version: int
    seconds: float
    bytes: int
    """Bytes the sender put on the channel."""
    members: int
    failed: str = ""
    """Why the sync failed for some member (it was lost, or retried as a joiner), or empty."""


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
    synced: bool = True
    """Holds a whole version the pool gave it: False for a worker that started after the first
    version was opened, or whose receive failed, until :meth:`GenerationPool.sync_joiners`."""
    failed_syncs: int = 0
    restarts: int = 0
    generated: int = 0
    lost: int = 0
    calls: set[Any] = field(default_factory=set)
    """ObjectRefs of this worker's calls in flight."""
    seq: int = 0
    """The sequence number of its next ordered call (submit, receive)."""
    ordered: int = 0
    """Ordered calls sent and not yet answered."""
    in_flight: dict[str, int] = field(default_factory=dict)
    """group_id -> the tokens its sequences need, of every group submitted and not reported."""
    collecting: Any = None
    """The ObjectRef of its ``collect`` call in flight, if any."""
    kv_cache_tokens: int | None = None
    peak_in_flight: int = 0
    last_error: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    """What the worker's probe answered (host, pid ...)."""
    behind: bool = False
    """Left out of the newest version's sync because it held yielding groups (validation): it
    finishes its groups on its weights, takes no new one, and turns joiner once it holds none."""
    yielding: set[str] = field(default_factory=set)
    """Ids of the yielding groups it holds (:attr:`GenerationRequest.yields`)."""
    loads: int = 0
    """Weight receives sent to it and not yet answered."""
    after_load: set[str] = field(default_factory=set)
    """Groups submitted behind a pending receive: they wait for it, not generating yet."""
    clock: BusyClock = field(default_factory=BusyClock)
    """When it generated (held groups not waiting for a receive), for the idle share."""


class _Refusal:
    """Asked by a sender between buckets: has a member's receive already failed (it refused the
    plan, or lost its group)? Then the sync ends now, not after the channel's timeout. Looks at
    most every 0.1 s."""

    def __init__(self, refs: tuple[Any, ...]) -> None:
        self.refs = list(refs)
        self.seen = ""
        self._last = 0.0

    def __call__(self) -> bool:
        import ray

        now = time.monotonic()
        if self.seen or now - self._last < 0.1:
            return bool(self.seen)
        self._last = now
        done, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        for ref in done:
            try:
                ray.get(ref, timeout=0)
            except Exception as err:
                self.seen = f"a member's receive failed: {str(err).splitlines()[0][:300]}"
        return bool(self.seen)


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
        max_in_flight_groups: int | None = None,
        max_restarts: int | None = 3,
        max_start_failures: int = 3,
        actor_options: Mapping[str, Any] | None = None,
        name: str = "gen",
    ) -> None:
        """``max_in_flight_groups``: groups each worker holds at once at most (None: as many as
        need up to :data:`KV_OVERCOMMIT` times its KV cache, for vLLM, else
        :data:`DEFAULT_IN_FLIGHT_GROUPS`); ``max_restarts``: replacements of each worker (None:
        no limit, for workers whose pods come and go), but a worker whose actor fails to start
        ``max_start_failures`` times in a row is given up; ``actor_options`` go to
        ``ray.remote(...).options`` (default: 1 GPU for vLLM on CUDA, 1 CPU else; e.g. a custom
        resource that only worker nodes offer)."""
        import ray

        if num_workers < 1:
            raise ValueError("generation.workers must be >= 1")
        if not ray.is_initialized():
            raise GenerationPoolError("Ray is not initialised; call ray.init() (or connect to the cluster) first")
        self.spec = spec
        self.max_in_flight_groups = max_in_flight_groups
        self.max_restarts = max_restarts
        self.max_start_failures = max(1, max_start_failures)
        on_gpu = spec.kind == "vllm" and spec.device.startswith("cuda")
        default_options: dict[str, Any] = {"num_gpus": 1} if on_gpu else {"num_cpus": 1}
        self._actor_options = {**default_options, "max_restarts": 0, **(actor_options or {})}
        self._actor_class = ray.remote(GenerationWorker)
        self._actor_options["max_concurrency"] = ACTOR_THREADS
        self._name = name
        self._lock = threading.RLock()
        self._queue: deque[GenerationRequest | _Load] = deque()
        """Requests and weight versions in the order they go to the workers."""
        self._held: dict[int, list[GenerationRequest]] = {}
        """Requests for versions not given to the pool yet, by version."""
        self._given: int | None = None
        """The newest version given to :meth:`give` (None: none yet; the workers'
        initial weights are version 0)."""
        self._current: int | None = None
        """The version last opened (None: none yet; the workers hold their initial weights)."""
        self._sender: Any = None
        self._sending: int | None = None
        """The version whose sender waits in :meth:`sync`: its load may be opened."""
        self._opened: _Opened | None = None
        self._epoch = 0
        self._channel_key: tuple[Any, ...] = ()
        """(sender's host, port, members) of the current epoch: a change forms a new epoch."""
        self._watcher: ChannelWatch | None = None
        """A client of a remote sender's store (a trainer group's rank 0) for the sync's lifecycle."""
        self._calls: dict[Any, _Call] = {}
        self._assigned: dict[str, str] = {}
        self._outbox: list[WorkerReport] = []
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
        """Queues groups for generation, each before the load of any version newer than the one
        it asks for (see the module docstring). A group id already queued or in flight is an
        error, and then none of ``requests`` is queued."""
        batch = list(requests)
        with self._lock:
            seen = self._known_ids()
            for request in batch:
                if request.group_id in seen:
                    raise ValueError(f"group {request.group_id} is already queued or in flight")
                seen.add(request.group_id)
            for request in batch:
                self._place(request)
            self._dispatch()

    def poll(self, timeout: float | None = 0.0) -> list[WorkerReport]:
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

    def give(self, version: int) -> None:
        """Gives the pool weight version ``version``: it joins the queue, so every request
        submitted before it (and every later one that asks for an older version, while this one
        waits) is generated with the older weights. Versions must increase. The bytes go when
        the version's turn comes, by :meth:`sync`."""
        with self._lock:
            if self._frozen:
                return  # nothing is sent to a worker any more (a barrier parked the run)
            if self._given is not None and version <= self._given:
                raise ValueError(f"weight version {version} given after version {self._given}: versions must increase")
            self._given = version
            self._queue.append(_Load(version))
            for v in sorted(v for v in self._held if v <= version):
                self._queue.extend(self._held.pop(v))
            self._dispatch()

    def sync(
        self,
        version: int,
        sender: Any,
        cancelled: Callable[[], bool] | None = None,
        waiting: Callable[[], None] | None = None,
    ) -> SyncResult:
        """Sends ``version`` (given with :meth:`give`) from ``sender`` (a
        :class:`~spotrl_runtime.generation.weights.WeightSender` holding those weights, which
        must not change meanwhile) to every ready worker, once its turn comes: after every
        request queued before it was dispatched. Returns once every member loaded it, or failed
        to (a failed member's groups come back lost; a live one is retried as a joiner).
        ``cancelled`` (a barrier) ends the wait and the send at once: the weights will never be
        used. The sender's process is the caller's, so call it from the thread that trains;
        ``waiting`` is called every 0.1 s or so while the version waits for its turn (the
        trainer's chores while it waits: cuts by the clock)."""
        from spotrl_runtime.generation.weights import WeightSyncCancelledError

        started = time.monotonic()
        with self._lock:
            self._sender, self._sending = sender, version
            self._dispatch()
        opened = self._wait_opened(version, cancelled, waiting)
        while opened is _JOINERS_WAIT:
            # The requests before this version wait for a worker, and the only ones up hold no
            # whole version (they restarted): they get this one now, which generates those
            # requests too (each outcome says so). Else nothing would move: joiners are served
            # by this very thread.
            self.sync_joiners(sender, version, cancelled)
            opened = self._wait_opened(version, cancelled, waiting)
        if opened is None or isinstance(opened, str):
            raise WeightSyncCancelledError(f"the sync of weight version {version} was cancelled before it began")
        return self._send(opened, sender, started, cancelled, waiting)

    def sync_joiners(self, sender: Any, version: int, cancelled: Callable[[], bool] | None = None) -> SyncResult | None:
        """Gives ``version`` (the sender's weights now, at least the newest opened) to the ready
        workers that hold no whole version yet (started late, restarted, or torn); None when
        there is none. Call it between steps from the thread that trains."""
        started = time.monotonic()
        with self._lock:
            if self._frozen:
                return None
            joiners = tuple(w.worker_id for w in self._workers.values() if w.alive and w.ready and not w.synced)
            if not joiners:
                return None
            opened = self._open(version, joiners, sender)
        log.info("generation worker(s) %s get weight version %d before their first group", ", ".join(joiners), version)
        return self._send(opened, sender, started, cancelled)

    def version(self) -> int:
        """The newest weight version given to the pool (0: none yet, the workers' initial weights)."""
        with self._lock:
            return self._given if self._given is not None else 0

    # ------------------------------------------------------------------ introspection

    def wait_ready(
        self, timeout: float = 300.0, min_ready: int | None = None, stop: threading.Event | None = None
    ) -> None:
        """Blocks until ``min_ready`` workers (default: every live one) have built their backend,
        or ``stop`` is set. Raises :class:`GenerationPoolError` when they have not within
        ``timeout`` seconds, or when every worker is dead and out of restarts. A worker that is
        up but holds no whole version yet counts as ready: :meth:`sync_joiners` gives it one."""
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

    def busy_seconds(self, start: float, end: float) -> dict[str, float]:
        """Per worker (every one the pool runs, dead or restarting included): the seconds it
        generated between ``start`` and ``end`` (``time.monotonic()``), as the pool saw it: from
        a group's submit to its outcome, less the time groups waited behind a weight receive.
        Forgets what ended before ``start``: ask for consecutive windows."""
        with self._lock:
            self._clock()
            return {w.worker_id: w.clock.busy_seconds(start, end) for w in self._workers.values()}

    def in_flight(self) -> int:
        """Groups sent to workers and not yet reported."""
        with self._lock:
            return len(self._assigned)

    def calls_in_flight(self) -> int:
        """Actor calls (probes, weight loads, submits, collects) not yet answered: with none,
        :meth:`poll` has nothing to wait on and returns at once."""
        with self._lock:
            return len(self._calls)

    def queued(self) -> int:
        """Groups waiting for a free worker or for their weight version."""
        with self._lock:
            waiting = sum(1 for item in self._queue if isinstance(item, GenerationRequest))
            return waiting + sum(len(held) for held in self._held.values())

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
                    "synced": w.synced,
                    "behind": w.behind,
                    "restarts": w.restarts,
                    "generated": w.generated,
                    "lost": w.lost,
                    "in_flight": len(w.in_flight),
                    "peak_in_flight": w.peak_in_flight,
                    "kv_cache_tokens": w.kv_cache_tokens,
                    "last_error": w.last_error,
                }
                for w in self._workers.values()
            ]

    def actor(self, worker_id: str) -> Any:
        """The Ray actor handle of a worker (to inspect it, or to kill it in a test)."""
        with self._lock:
            return self._workers[worker_id].actor

    def abort(self, timeout: float = 1.0) -> int:
        """Stops every group in flight at every worker with the engine's own abort (vLLM frees
        their KV blocks); each comes back from :meth:`poll` as :class:`GroupLost`, to be
        redispatched with its id. Waits up to ``timeout`` s for the workers' answers; returns
        how many answered."""
        import ray

        with self._lock:
            refs = []
            for w in self._workers.values():
                if w.alive and w.ready:
                    ref = w.actor.abort.remote()
                    self._calls[ref] = _Call("abort", w.worker_id)
                    w.calls.add(ref)
                    refs.append(ref)
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout) if refs else ([], [])
        with self._lock:
            for ref in done:
                self._complete(ref)
        return len(done)

    def freeze(self, abort_wait: float = 1.0) -> list[int]:
        """Takes the workers' CPU away at once, for a barrier's writer: their groups are aborted
        (waiting up to ``abort_wait`` s), then a worker in this process's host (its pid
        namespace) is paused (SIGSTOP), not killed: a kill would have it, and Ray, tear down its
        gigabytes beside the writer. Nothing is sent to any worker from now on; :meth:`shutdown`
        ends them. Returns the pids paused."""
        with self._lock:
            self._frozen = True
            self._queue.clear()
            self._held.clear()
            self._sending = None
        if abort_wait > 0:
            self.abort(abort_wait)
        with self._lock:
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
            self._held.clear()

    # ------------------------------------------------------------------ internals (lock held)

    def _launch(self, worker: _Worker) -> None:
        """Starts the worker's actor and probes it: it takes groups once the probe answers."""
        worker.actor = self._actor_class.options(**self._actor_options).remote(self.spec, worker.worker_id)
        worker.alive = True
        worker.ready = False
        worker.weight_version = 0
        worker.failed_syncs = 0
        worker.seq = worker.ordered = worker.loads = 0
        worker.collecting = None
        worker.behind = False
        worker.yielding.clear()
        worker.after_load.clear()
        probe = worker.actor.info.remote()
        self._calls[probe] = _Call("probe", worker.worker_id)
        worker.calls.add(probe)

    def _known_ids(self) -> set[str]:
        queued = {item.group_id for item in self._queue if isinstance(item, GenerationRequest)}
        held = {r.group_id for requests in self._held.values() for r in requests}
        return queued | held | set(self._assigned)

    def _place(self, request: GenerationRequest) -> None:
        """Puts ``request`` where its weight version will generate it: held while that version
        was not given, else before the first queued load of a newer version."""
        version = request.weight_version
        if version is None:
            self._queue.append(request)
            return
        if version > self.version():
            self._held.setdefault(version, []).append(request)
            return
        loads = (i for i, item in enumerate(self._queue) if isinstance(item, _Load) and item.version > version)
        newer = next(loads, None)
        if newer is None:
            self._queue.append(request)
        else:
            self._queue.insert(newer, request)

    def _dispatch(self) -> None:
        """Sends the queue's head: a version is opened (when its sender waits for it), requests
        go to the least busy synced workers with room, in submits that never cross a load.
        Yielding groups (validation) do not hold a load up: see :meth:`_members`."""
        if self._frozen:
            return
        if self._sending is not None:
            self._release_yielding()
        while self._queue:
            head = self._queue[0]
            if isinstance(head, _Load):
                if self._sending != head.version:
                    break  # its sender is not there yet: nothing after it may go first
                self._queue.popleft()
                self._current = head.version
                self._opened = self._open(head.version, self._members(head.version), self._sender)
                continue
            if not self._dispatch_requests():
                break
        self._clock()

    def _takes_groups(self, w: _Worker) -> bool:
        """Holds the newest opened version (or the initial weights): it may be sent groups."""
        return w.alive and w.ready and w.synced and not w.behind

    def _members(self, version: int) -> tuple[str, ...]:
        """The workers that load ``version`` now. One holding yielding groups is left out (it
        falls behind: finishes them on its weights, then joins), as long as another loads it:
        the groups that ask for ``version`` need a worker holding it (a joiner could only be
        given a newer one), so when every worker holds yielding groups, the one holding the
        fewest loads it after them."""
        candidates = [w for w in self._workers.values() if self._takes_groups(w)]
        members = [w for w in candidates if not w.yielding]
        if not members and candidates:
            members = [min(candidates, key=lambda w: len(w.yielding))]
        for w in candidates:
            if w not in members:
                w.behind = True
                log.info(
                    "generation worker %s finishes %d validation group(s) on weight version %d outside the sync "
                    "of version %d, and joins after",
                    w.worker_id,
                    len(w.yielding),
                    w.weight_version,
                    version,
                )
        return tuple(w.worker_id for w in members)

    def _release_yielding(self) -> None:
        """When a load's sender waits: the yielding requests queued before the load go at once,
        beyond the budget (the engine queues them), to the worker holding the most yielding
        groups (else the least busy), which falls behind at the load (:meth:`_members`). Not
        with one worker: it loads the version, so it must take them first."""
        loads = (i for i, item in enumerate(self._queue) if isinstance(item, _Load) and item.version == self._sending)
        end = next(loads, None)
        candidates = [w for w in self._workers.values() if self._takes_groups(w)]
        if end is None or len(candidates) < 2:
            return
        early = [r for r in list(self._queue)[:end] if isinstance(r, GenerationRequest) and r.yields]
        worker = max(candidates, key=lambda w: (len(w.yielding), -len(w.in_flight)))
        if not early or worker.ordered >= MAX_ORDERED_CALLS:
            return
        for request in early:
            self._queue.remove(request)
        self._submit(worker, early)

    def _dispatch_requests(self) -> bool:
        """Sends the requests at the queue's head (up to the next load), each to the synced
        worker holding the fewest groups with room for it, one submit per worker. Yielding
        requests go to a worker that already holds some, if any (a pass runs on one worker,
        the others stay free to load), and wait for its room without holding up the requests
        behind them. True when a load is now at the head."""
        batches: dict[str, list[GenerationRequest]] = {}
        waiting: list[GenerationRequest] = []
        while self._queue and isinstance(self._queue[0], GenerationRequest):
            request = self._queue[0]
            room = [
                w
                for w in self._workers.values()
                if self._takes_groups(w)
                and (w.worker_id in batches or w.ordered < MAX_ORDERED_CALLS)
                and self._has_room(w, request)
            ]
            if request.yields and any(w.yielding for w in self._workers.values() if self._takes_groups(w)):
                room = [w for w in room if w.yielding]
            if not room:
                if not request.yields:
                    break
                waiting.append(request)
                self._queue.popleft()
                continue
            worker = min(room, key=lambda w: len(w.in_flight))
            self._queue.popleft()
            batches.setdefault(worker.worker_id, []).append(request)
            worker.in_flight[request.group_id] = _tokens(request)
            if request.yields:
                worker.yielding.add(request.group_id)
        self._queue.extendleft(reversed(waiting))
        for worker_id, batch in batches.items():
            self._submit(self._workers[worker_id], batch)
        return bool(self._queue) and isinstance(self._queue[0], _Load)

    def _submit(self, worker: _Worker, batch: list[GenerationRequest]) -> None:
        """Sends ``batch`` to ``worker`` in one ordered call."""
        for request in batch:
            worker.in_flight[request.group_id] = _tokens(request)
            self._assigned[request.group_id] = worker.worker_id
            if request.yields:
                worker.yielding.add(request.group_id)
            if worker.loads:
                worker.after_load.add(request.group_id)
        worker.peak_in_flight = max(worker.peak_in_flight, len(worker.in_flight))
        ref = worker.actor.submit.remote(worker.seq, batch)
        worker.seq += 1
        worker.ordered += 1
        self._calls[ref] = _Call("submit", worker.worker_id, tuple(r.group_id for r in batch))
        worker.calls.add(ref)
        self._collect(worker)

    def _has_room(self, worker: _Worker, request: GenerationRequest) -> bool:
        return has_room(worker.in_flight.values(), _tokens(request), self.max_in_flight_groups, worker.kv_cache_tokens)

    def _collect(self, worker: _Worker) -> None:
        """Keeps one ``collect`` call in flight at a worker that holds groups."""
        if worker.collecting is None and worker.in_flight and worker.alive:
            ref = worker.actor.collect.remote(COLLECT_WAIT)
            worker.collecting = ref
            self._calls[ref] = _Call("collect", worker.worker_id)
            worker.calls.add(ref)

    def _open(self, version: int, members: tuple[str, ...], sender: Any) -> _Opened:
        """Sends ``members`` their receive of ``version`` (queued behind their calls), in the
        channel's epoch for these members and this sender (a new one if either changed)."""
        channel = sender.channel
        key = (channel.host, channel.port, members)
        if key != self._channel_key:
            self._epoch += 1
            self._channel_key = key
        plan = sender.plan.to_dict()
        refs = []
        before = []
        ranks = self.spec.tensor_parallel_size  # channel ranks per member: one per engine rank
        for i, worker_id in enumerate(members):
            worker = self._workers[worker_id]
            before.append(frozenset(worker.in_flight))
            address = channel.address(self._epoch, len(members) * ranks + 1, 1 + i * ranks).to_dict()
            ref = worker.actor.receive_weights.remote(worker.seq, address, plan, version)
            worker.seq += 1
            worker.ordered += 1
            worker.loads += 1
            self._calls[ref] = _Call("load", worker_id, version=version)
            worker.calls.add(ref)
            refs.append(ref)
        return _Opened(version, self._epoch, members, tuple(refs), tuple(before))

    def _wait_opened(
        self, version: int, cancelled: Callable[[], bool] | None, waiting: Callable[[], None] | None = None
    ) -> _Opened | str | None:
        """Until ``version`` is opened (the requests before it dispatched), driving the calls in
        flight meanwhile; None if cancelled or frozen first; :data:`_JOINERS_WAIT` when the
        requests before it can only go to workers that wait for a whole version."""
        import ray

        while True:
            with self._lock:
                if self._opened is not None and self._opened.version == version:
                    opened, self._opened, self._sending = self._opened, None, None
                    return opened
                if self._frozen:
                    return None
                ready = [w for w in self._workers.values() if w.alive and w.ready]
                if ready and not any(w.synced for w in ready):
                    return _JOINERS_WAIT
                pending = list(self._calls)
            self._raise_if_all_dead()
            if cancelled is not None and cancelled():
                return None
            if waiting is not None:
                waiting()
            if not pending:
                time.sleep(0.01)
                continue
            done, _ = ray.wait(pending, num_returns=1, timeout=0.1)
            with self._lock:
                for ref in done:
                    self._complete(ref)
                self._dispatch()

    def _announce(
        self,
        opened: _Opened,
        channel: Any,
        cancelled: Callable[[], bool] | None,
        waiting: Callable[[], None] | None = None,
    ) -> SenderSync:
        """The sync's announce phase (:mod:`~spotrl_runtime.generation.sync_lifecycle`): the
        members drain and announce, the pool driving its calls meanwhile (``waiting``: the
        trainer's chores). A member lost or too slow ends the epoch: a slow one is replaced,
        as a dead one was; the others' receives end at once (the epoch's abort). A cancel
        (a barrier) raises."""
        from spotrl_runtime.generation.weights import WeightSyncCancelledError, await_announcements

        ranks = self.spec.tensor_parallel_size
        members = {m: tuple(range(1 + i * ranks, 1 + (i + 1) * ranks)) for i, m in enumerate(opened.members)}
        sync = SenderSync(opened.epoch, opened.version, members, channel.timeout)
        await_announcements(self._watch(channel), sync, look=lambda: self._look(opened, waiting), cancelled=cancelled)
        if sync.phase in (Phase.CANCELLED, Phase.FAILED):
            with self._lock:
                self._channel_key = ()  # the next sync forms a new epoch, of the healthy members
                for member in sync.culprits:
                    if opened.refs[opened.members.index(member)] in self._calls:  # alive, too slow
                        self._worker_lost(self._workers[member], f"weight sync: {sync.reason}")
        if sync.phase is Phase.CANCELLED:
            raise WeightSyncCancelledError(f"the sync of weight version {opened.version} was cancelled")
        return sync

    def _look(self, opened: _Opened, waiting: Callable[[], None] | None) -> tuple[set[str], dict[str, str]]:
        """Drives the calls in flight for up to 0.1 s while a member drains (a group's end wakes
        it), for 5 ms once none does (the announcements are due: the members' receives, pending
        until the send, would otherwise hold every sync up by the whole wait); then which members
        still drain (hold groups they held when their receive was sent) and which were lost
        (their receive ended: the worker died, or it refused)."""
        import ray

        if waiting is not None:
            waiting()
        with self._lock:
            pending = list(self._calls)
            drains = any(self._holds_older(opened, i) for i in range(len(opened.members)))
        done = ray.wait(pending, num_returns=1, timeout=0.1 if drains else 0.005)[0] if pending else []
        with self._lock:
            for ref in done:
                self._complete(ref)
            self._dispatch()
            draining, lost = set(), {}
            for i, (member, ref) in enumerate(zip(opened.members, opened.refs, strict=True)):
                if ref not in self._calls:
                    lost[member] = self._workers[member].last_error or "its weight receive ended before the sync began"
                elif self._holds_older(opened, i):
                    draining.add(member)
        if not pending:
            time.sleep(0.01)
        return draining, lost

    def _holds_older(self, opened: _Opened, i: int) -> bool:
        """Whether member ``i`` still holds groups it held when its receive was sent."""
        return bool(opened.before[i] & self._workers[opened.members[i]].in_flight.keys())

    def _watch(self, channel: Any) -> ChannelWatch:
        """A client of the channel's store for the lifecycle's keys (one per sender)."""
        from spotrl_runtime.generation.weights import ChannelWatch

        own = getattr(channel, "watch", None)  # a ChannelHost in this process has one
        if isinstance(own, ChannelWatch):
            return own
        if self._watcher is None or self._watcher.at != (channel.host, channel.port):
            self._watcher = ChannelWatch(channel.host, channel.port, channel.timeout)
        return self._watcher

    def _send(
        self,
        opened: _Opened,
        sender: Any,
        started: float,
        cancelled: Callable[[], bool] | None,
        waiting: Callable[[], None] | None = None,
    ) -> SyncResult:
        """An opened version's lifecycle: the members' announcements (their drain), the
        sender's half, then the members' answers (each within the channel's timeout: a member
        that does not answer is replaced)."""
        import ray

        from spotrl_runtime.generation.weights import WeightSyncCancelledError, WeightSyncError

        if not opened.members:
            return SyncResult(opened.version, time.monotonic() - started, 0, 0)
        announce = self._announce(opened, sender.channel, cancelled, waiting)
        failed = announce.reason if announce.phase is Phase.FAILED else ""
        sent = 0
        refused = _Refusal(opened.refs)
        try:
            if not failed:  # every member announced: the sender's clock starts now
                sent = sender.send(
                    opened.epoch,
                    len(opened.members) * self.spec.tensor_parallel_size + 1,
                    opened.version,
                    lambda: (cancelled is not None and cancelled()) or refused(),
                )
        except WeightSyncError as err:
            if isinstance(err, WeightSyncCancelledError) and not refused.seen:
                with self._lock:
                    self._channel_key = ()
                raise
            failed = refused.seen or str(err)
            with self._lock:
                self._channel_key = ()  # the next sync forms the channel anew
        deadline = time.monotonic() + sender.channel.timeout
        pending = list(opened.refs)
        while pending and time.monotonic() < deadline:
            if cancelled is not None and cancelled():
                raise WeightSyncCancelledError(f"the sync of weight version {opened.version} was cancelled")
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.1)
            with self._lock:
                for ref in done:
                    self._complete(ref)
        with self._lock:
            for ref in pending:
                call = self._calls.get(ref)
                if call is not None:
                    self._worker_lost(self._workers[call.worker_id], "its weight receive did not finish in time")
            self._dispatch()
        if failed:
            log.warning("the sync of weight version %d failed for some member: %s", opened.version, failed)
        return SyncResult(opened.version, time.monotonic() - started, sent, len(opened.members), failed)

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
            self._failed(worker, call, err)
            self._clock()
            return
        self._settle(ref)
        if call.kind == "probe":
            self._up(worker, value)
        elif call.kind == "load":
            worker.weight_version = int(value)
            worker.synced = True
            worker.failed_syncs = 0
        elif call.kind == "collect":
            self._report(worker, value)
            self._collect(worker)
        self._clock()

    def _clock(self) -> None:
        """Marks on each worker's clock whether it generates now: alive and holding a group
        that does not wait for a receive. Called after every change of what workers hold."""
        now = time.monotonic()
        for w in self._workers.values():
            w.clock.mark(w.alive and any(g not in w.after_load for g in w.in_flight), now)

    def _failed(self, worker: _Worker, call: _Call, err: Exception) -> None:
        """A call that raised in a live worker."""
        if call.kind == "submit":
            for gid in call.group_ids:
                worker.in_flight.pop(gid, None)
                self._assigned.pop(gid, None)
            self._held_less(worker)
            error = f"{type(err).__name__}: {err}"
            self._outbox.extend(GroupFailed(gid, error, worker.worker_id) for gid in call.group_ids)
        elif call.kind == "collect":
            self._worker_lost(worker, f"collect failed: {err}")
        elif call.kind == "load" and (_ended_by_sender(err) or worker.failed_syncs + 1 < MAX_FAILED_SYNCS):
            # Alive with torn weights: it generates nothing (the groups submitted after the
            # receive come back lost) until a joiner's sync gives it a whole version. A receive
            # the sender ended (another member lost, a barrier) is no fault of this worker's.
            worker.failed_syncs += 0 if _ended_by_sender(err) else 1
            worker.synced = False
            self._channel_key = ()  # its epoch is over (its group destroyed): the next sync forms a new one
            worker.last_error = f"weight receive failed: {str(err).splitlines()[0][:300]}"
        elif call.kind != "abort":
            worker.last_error = f"{'receive_weights' if call.kind == 'load' else 'info'} failed: {err}"
            self._worker_lost(worker, worker.last_error)

    def _up(self, worker: _Worker, info: Mapping[str, Any]) -> None:
        """A worker answered its probe: its backend is built, it takes groups."""
        worker.ready = True
        worker.synced = self._current is None  # else it waits for a joiner's sync
        worker.start_failures = 0
        worker.info = dict(info)
        worker.kv_cache_tokens = info.get("kv_cache_tokens") or None
        log.info(
            "generation worker %s is up on node %s (%s backend, pid %s, restarts %d)",
            worker.worker_id,
            worker.info.get("node_ip") or worker.info.get("host"),
            worker.info.get("kind"),
            worker.info.get("pid"),
            worker.restarts,
        )

    def _report(self, worker: _Worker, outcomes: Iterable[WorkerReport]) -> None:
        """Outcomes a worker's ``collect`` returned go to the outbox (a group it no longer
        holds, one already declared lost, is dropped); so do the turns of a group it holds."""
        for outcome in outcomes:
            if isinstance(outcome, TurnsFinished):
                if outcome.group_id in worker.in_flight:  # the group is still this worker's
                    self._outbox.append(outcome)
                continue
            if worker.in_flight.pop(outcome.group_id, None) is None:
                continue
            self._assigned.pop(outcome.group_id, None)
            if isinstance(outcome, GroupLost):
                worker.lost += 1
            elif hasattr(outcome, "samples"):
                worker.generated += 1
            self._outbox.append(outcome)
        self._held_less(worker)

    def _held_less(self, worker: _Worker) -> None:
        """Some of the worker's groups were reported: a worker behind that holds none now
        turns joiner (it gets the newest version from :meth:`sync_joiners`)."""
        worker.yielding &= worker.in_flight.keys()
        worker.after_load &= worker.in_flight.keys()
        if worker.behind and not worker.in_flight:
            worker.behind = False
            worker.synced = False

    def _settle(self, ref: Any) -> None:
        call = self._calls.pop(ref)
        worker = self._workers[call.worker_id]
        worker.calls.discard(ref)
        if call.kind in ("submit", "load"):
            worker.ordered -= 1
        if call.kind == "load":
            worker.loads -= 1
            if not worker.loads:
                worker.after_load.clear()  # the receive is done: they generate now
        elif call.kind == "collect":
            worker.collecting = None

    def _worker_lost(self, worker: _Worker, reason: str) -> None:
        """Every group the worker held comes back as lost; the worker is replaced if allowed."""
        import ray

        if not worker.alive:
            return
        worker.alive = False
        worker.last_error = reason
        for ref in list(worker.calls):
            self._settle(ref)
        worker.lost += len(worker.in_flight)
        self._outbox.extend(GroupLost(gid, worker.worker_id, reason) for gid in worker.in_flight)
        for gid in worker.in_flight:
            self._assigned.pop(gid, None)
        worker.in_flight.clear()
        worker.ready = False
        self._clock()
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

    def _raise_if_all_dead(self) -> None:
        with self._lock:
            if self._workers and not any(w.alive for w in self._workers.values()):
                reasons = "; ".join(f"{w.worker_id}: {w.last_error}" for w in self._workers.values())
                raise GenerationPoolError(f"every generation worker is dead and out of restarts ({reasons})")


def _ended_by_sender(err: BaseException) -> bool:
    """Whether a worker's receive raised because the sender ended the epoch (Ray's task error
    carries the worker's exception as its ``cause``)."""
    from spotrl_runtime.generation.weights import WeightSyncCancelledError

    return isinstance(getattr(err, "cause", None), WeightSyncCancelledError)


def _tokens(request: GenerationRequest) -> int:
    """The tokens a group's sequences need in a KV cache at most."""
    return request.n * (len(request.prompt_token_ids) + request.max_new_tokens)


def has_room(in_flight: Iterable[int], tokens: int, max_groups: int | None, kv_cache_tokens: int | None) -> bool:
    """Whether a worker holding groups that need ``in_flight`` tokens each may take one more
    that needs ``tokens``: up to ``max_groups`` groups when set, else up to
    :data:`KV_OVERCOMMIT` times its KV cache (vLLM), else :data:`DEFAULT_IN_FLIGHT_GROUPS`.
    A worker holding nothing always may (a group bigger than the budget still runs)."""
    held = list(in_flight)
    if not held:
        return True
    if max_groups:
        return len(held) < max_groups
    if kv_cache_tokens:
        return sum(held) + tokens <= KV_OVERCOMMIT * kv_cache_tokens
    return len(held) < DEFAULT_IN_FLIGHT_GROUPS
