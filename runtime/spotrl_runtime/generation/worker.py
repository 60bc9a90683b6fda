"""A generation worker: one backend behind the methods a Ray actor exposes.

The class is plain Python (tested directly); :class:`~.pool.GenerationPool` runs it as a Ray
actor with ``ray.remote(GenerationWorker)``. Ray runs an actor's calls one at a time in the
order one caller sent them, so a ``receive_weights`` sent after some ``generate`` calls takes
effect exactly between them, and each result says which weight version produced it.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from spotrl_runtime.failpoints import failpoint
from spotrl_runtime.generation.backend import BackendSpec, GenerationBackend
from spotrl_runtime.generation.types import GenerationRequest, GroupFailed, GroupGenerated, GroupLost
from spotrl_runtime.generation.weights import ChannelAddress, SyncPlan


def build_backend(spec: BackendSpec) -> GenerationBackend:
    """Builds the backend ``spec`` names, loading the policy (vLLM is imported only here)."""
    if spec.kind == "transformers":
        from spotrl_runtime.generation.transformers_backend import TransformersBackend

        return TransformersBackend.from_spec(spec)
    if spec.kind == "vllm":
        from spotrl_runtime.generation.vllm_backend import VLLMBackend

        return VLLMBackend.from_spec(spec)
    raise ValueError(f"generation.backend: {spec.kind!r} is not one of 'transformers', 'vllm'")


class GenerationWorker:
    """Wraps a backend; reports a failure per group instead of failing the whole call."""

    def __init__(self, spec: BackendSpec, worker_id: str, backend: GenerationBackend | None = None) -> None:
        self.worker_id = worker_id
        self.spec = spec
        self.backend = backend if backend is not None else build_backend(spec)
        self.started = time.time()
        self.torn = ""
        """Why the weights are torn (a receive failed), or empty."""

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GroupGenerated | GroupFailed | GroupLost]:
        """One outcome per request, in order. If the batch raises, each group is retried alone so
        that one bad group fails by itself and the others still come back generated. With torn
        weights (a receive that failed) nothing is generated: the groups come back lost, to be
        redispatched elsewhere."""
        if self.torn:
            return [GroupLost(r.group_id, self.worker_id, f"weights torn: {self.torn}") for r in requests]
        failpoint("worker.generate", self.backend.weight_version)
        try:
            return [self._stamp(r) for r in self.backend.generate(requests)]
        except Exception:
            if len(requests) == 1:
                return [GroupFailed(requests[0].group_id, traceback.format_exc(limit=8), self.worker_id)]
        outcomes: list[GroupGenerated | GroupFailed | GroupLost] = []
        for request in requests:
            outcomes.extend(self.generate([request]))
        return outcomes

    def receive_weights(self, address: Mapping[str, Any], plan: Mapping[str, Any], version: int) -> int:
        """Joins the weight channel's epoch ``address`` names and receives ``version`` over it
        (:mod:`~spotrl_runtime.generation.weights`); returns the version now in use. A receive
        that fails leaves the weights torn: the worker then generates nothing more."""
        failpoint("worker.load_weights", version)
        try:
            self.backend.join_channel(ChannelAddress(**address))
            self.backend.receive_weights(SyncPlan.from_dict(plan), version)
        except BaseException as err:
            self.torn = f"the receive of version {version} failed: {type(err).__name__}: {err}"[:500]
            raise
        self.torn = ""
        return self.backend.weight_version

    def weight_version(self) -> int:
        return self.backend.weight_version

    def info(self) -> dict[str, Any]:
        """Where the worker runs, for logs and metrics (also a cheap readiness probe)."""
        return {
            "worker": self.worker_id,
            "kind": self.spec.kind,
            "host": socket.gethostname(),
            "node_ip": _node_ip(),
            "pid": os.getpid(),
            "weight_version": self.backend.weight_version,
        }

    def close(self) -> None:
        self.backend.close()

    def _stamp(self, result: GroupGenerated) -> GroupGenerated:
        from dataclasses import replace

        return replace(result, worker=self.worker_id)


def _node_ip() -> str | None:
    """The address of the Ray node this runs on (a worker pod's IP with workerPods)."""
    try:
        import ray

        return str(ray.util.get_node_ip_address()) if ray.is_initialized() else None
    except Exception:
        return None
