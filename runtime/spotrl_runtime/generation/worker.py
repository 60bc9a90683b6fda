"""A generation worker: one backend behind the methods a Ray actor exposes.

The class is plain Python (tested directly); :class:`~.pool.GenerationPool` runs it as a
threaded Ray actor. Groups stream: :meth:`GenerationWorker.submit` hands them to the backend
at once and :meth:`GenerationWorker.collect` returns each as it finishes. Ordered calls carry
sequence numbers, so a ``receive_weights`` sent after some submits takes effect exactly after
their groups finished, and each result says which weight version produced it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from spotrl_runtime.failpoints import failpoint
from spotrl_runtime.generation.backend import BackendSpec, GenerationBackend
from spotrl_runtime.generation.types import (
    GenerationRequest,
    GroupFailed,
    GroupGenerated,
    GroupLost,
    TurnsFinished,
    WorkerReport,
)
from spotrl_runtime.generation.weights import ChannelAddress, SyncPlan, live_links


def build_backend(spec: BackendSpec) -> GenerationBackend:
    """Builds the backend ``spec`` names, loading the policy (vLLM is imported only here); with
    ``spec.environment``, the turn loop around it."""
    engine = _engine(spec)
    if spec.environment is None:
        return engine
    from spotrl_runtime.rollouts.episodes import EpisodeBackend

    return EpisodeBackend.from_spec(engine, spec.environment, max_model_len=spec.max_model_len)


def _engine(spec: BackendSpec) -> GenerationBackend:
    if spec.kind == "transformers":
        from spotrl_runtime.generation.transformers_backend import TransformersBackend

        return TransformersBackend.from_spec(spec)
    if spec.kind == "vllm":
        from spotrl_runtime.generation.vllm_backend import VLLMBackend

        return VLLMBackend.from_spec(spec)
    raise ValueError(f"generation.backend: {spec.kind!r} is not one of 'transformers', 'vllm'")


class GenerationWorker:
    """Wraps a backend and streams its groups: :meth:`submit` starts them, a thread of the
    worker's own steps the backend, and :meth:`collect` returns each outcome as it finishes.

    The pool's calls that must take effect in its order (:meth:`submit`, :meth:`receive_weights`)
    carry a sequence number, and each waits for the one before it: the actor is threaded
    (a :meth:`collect` waits beside them), and Ray does not keep a threaded actor's calls in
    order. A receive first lets every group submitted before it finish on the weights it asked
    for (the backend's own scheduling keeps running meanwhile), then loads the new ones."""

    def __init__(self, spec: BackendSpec, worker_id: str, backend: GenerationBackend | None = None) -> None:
        self.worker_id = worker_id
        self.spec = spec
        self.backend = backend if backend is not None else build_backend(spec)
        self._threads = torch.get_num_threads()
        """The backend's CPU threads, as built; see :meth:`_in_thread`."""
        self.started = time.time()
        self.torn = ""
        """Why the weights are torn (a receive failed), or empty."""
        self._cv = threading.Condition()
        self._next = 0
        """The sequence number of the next ordered call."""
        self._inbox: list[GenerationRequest] = []
        self._outbox: list[WorkerReport] = []
        self._unfinished = 0
        """Groups submitted and not yet in the outbox."""
        self._engine = threading.Lock()
        """Held while the backend steps or loads weights."""
        self._closed = False
        self.peak_generating = 0
        self.steps = 0
        """Steps of the backend so far."""
        self._generating_sum = 0
        """The most groups the backend held unfinished at once."""
        self._runner = threading.Thread(target=self._run, name=f"{worker_id}-generate", daemon=True)
        self._runner.start()

    # ------------------------------------------------------------------ ordered calls

    def submit(self, seq: int, requests: Sequence[GenerationRequest]) -> int:
        """Starts generating ``requests`` (ordered call ``seq``); returns how many were taken.
        With torn weights (a receive that failed) nothing is generated: the groups come back
        lost, to be redispatched elsewhere."""
        with self._ordered(seq), self._cv:
            if self.torn:
                reason = f"weights torn: {self.torn}"
                self._outbox.extend(GroupLost(r.group_id, self.worker_id, reason) for r in requests)
                self._cv.notify_all()
                return 0
            self._inbox.extend(requests)
            self._unfinished += len(requests)
            self._cv.notify_all()
            return len(requests)

    def receive_weights(self, seq: int, address: Mapping[str, Any], plan: Mapping[str, Any], version: int) -> int:
        """Once every group submitted before it has finished (ordered call ``seq``), joins the
        weight channel's epoch ``address`` names and receives ``version`` over it
        (:mod:`~spotrl_runtime.generation.weights`); returns the version now in use. A receive
        that fails leaves the weights torn: the worker then generates nothing more."""
        with self._ordered(seq):
            with self._cv:
                self._cv.wait_for(lambda: not self._unfinished or self._closed)
            with self._engine:
                self._in_thread()
                failpoint("worker.load_weights", version)
                try:
                    self.backend.join_channel(ChannelAddress(**address))
                    self.backend.receive_weights(SyncPlan.from_dict(plan), version)
                except BaseException as err:
                    self.torn = f"the receive of version {version} failed: {type(err).__name__}: {err}"[:500]
                    raise
            self.torn = ""
            return self.backend.weight_version

    # ------------------------------------------------------------------ unordered calls

    def collect(self, timeout: float = 1.0) -> list[WorkerReport]:
        """The outcomes finished since the last call, and the turns a multi-turn group's episodes
        finished, waiting up to ``timeout`` s for one."""
        with self._cv:
            self._cv.wait_for(lambda: self._outbox or self._closed, timeout)
            out, self._outbox = self._outbox, []
            return out

    def abort(self) -> list[str]:
        """Stops every group submitted and unfinished (vLLM's own abort frees their KV blocks);
        each comes back from :meth:`collect` as lost, for redispatch with its id. Returns their
        ids."""
        with self._engine:
            with self._cv:
                queued = [r.group_id for r in self._inbox]
                self._inbox.clear()
            started = self.backend.abort()
        ids = queued + started
        with self._cv:
            self._outbox.extend(GroupLost(gid, self.worker_id, "aborted") for gid in ids)
            self._unfinished -= len(ids)
            self._cv.notify_all()
        return ids

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GroupGenerated | GroupFailed | GroupLost]:
        """Generates ``requests`` and waits for them, in order (not through the pool: tests,
        tools). The worker's next ordered call is taken for it."""
        with self._cv:
            seq = self._next
        self.submit(seq, requests)
        wanted = {r.group_id for r in requests}
        done: dict[str, GroupGenerated | GroupFailed | GroupLost] = {}
        while wanted - done.keys():
            for outcome in self.collect(timeout=1.0):
                if not isinstance(outcome, TurnsFinished):
                    done[outcome.group_id] = outcome
        return [done[r.group_id] for r in requests]

    def weight_version(self) -> int:
        return self.backend.weight_version

    def info(self) -> dict[str, Any]:
        """Where the worker runs, for logs and metrics (also a cheap readiness probe), what its
        engine holds (``kv_cache_tokens``, vLLM only), and the weight channel's process groups
        alive in it (``channel_groups``: one at most once each retired one was destroyed)."""
        kv_tokens = getattr(self.backend, "kv_cache_tokens", None)
        return {
            "worker": self.worker_id,
            "kind": self.spec.kind,
            "host": socket.gethostname(),
            "node_ip": _node_ip(),
            "pid": os.getpid(),
            "weight_version": self.backend.weight_version,
            "kv_cache_tokens": kv_tokens() if callable(kv_tokens) else None,
            "channel_groups": live_links(),
            "peak_generating": self.peak_generating,
            "mean_generating": self._generating_sum / self.steps if self.steps else 0.0,
        }

    def stop(self) -> None:
        """Stops the worker's thread (the backend stays as it is)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._runner.join(timeout=30)

    def close(self) -> None:
        self.stop()
        self.backend.close()

    # ------------------------------------------------------------------ internals

    @contextlib.contextmanager
    def _ordered(self, seq: int) -> Iterator[None]:
        """Runs ordered call ``seq`` after every call before it (its body takes the lock it needs,
        so that :meth:`collect` and the runner go on meanwhile)."""
        with self._cv:
            if seq < self._next:
                raise ValueError(f"{self.worker_id}: ordered call {seq} came after call {self._next - 1}")
            self._cv.wait_for(lambda: self._next == seq)
        try:
            yield
        finally:
            with self._cv:
                self._next += 1
                self._cv.notify_all()

    def _run(self) -> None:
        """Starts what was submitted and steps the backend while any group is unfinished."""
        self._in_thread()
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or self._inbox or self.backend.unfinished())
                if self._closed:
                    return
            with self._engine:
                with self._cv:  # under the engine's lock: an abort finds each group in one place
                    new, self._inbox = self._inbox, []
                if new:
                    failpoint("worker.generate", self.backend.weight_version)
                outcomes = self._step(new)
                generating = self.backend.unfinished() + sum(1 for o in outcomes if not isinstance(o, TurnsFinished))
                self.peak_generating = max(self.peak_generating, generating)
                self._generating_sum += generating
                self.steps += 1
            failpoint("worker.stepped", self.steps)
            with self._cv:
                self._outbox.extend(replace(outcome, worker=self.worker_id) for outcome in outcomes)
                self._unfinished -= sum(1 for o in outcomes if not isinstance(o, TurnsFinished))
                self._cv.notify_all()

    def _in_thread(self) -> None:
        """Gives the calling thread the backend's thread count: OpenMP's is per thread, and
        vLLM's CPU attention refuses to run with another count than its metadata was built
        with ("thread_num == thread_num" fails, and the process aborts)."""
        if torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)

    def _step(self, new: list[GenerationRequest]) -> list[GroupGenerated | GroupFailed | TurnsFinished]:
        """One step of the backend, having started ``new``; an engine that raises fails every
        group it held (each may be retried elsewhere)."""
        try:
            self.backend.start(new)
            return list(self.backend.step())
        except Exception:
            error = traceback.format_exc(limit=8)
            ids = {r.group_id for r in new} | set(self.backend.abort())
            return [GroupFailed(gid, error, self.worker_id) for gid in sorted(ids)]


def _node_ip() -> str | None:
    """The address of the Ray node this runs on (a worker pod's IP with workerPods)."""
    try:
        import ray

        return str(ray.util.get_node_ip_address()) if ray.is_initialized() else None
    except Exception:
        return None
