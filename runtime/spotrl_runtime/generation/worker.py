"""A generation worker: one backend behind the methods a Ray actor exposes.

The class is plain Python (tested directly); :class:`~.pool.GenerationPool` runs it as a Ray
actor with ``ray.remote(GenerationWorker)``. Ray runs an actor's calls one at a time in the
order one caller sent them, so a ``load_weights`` sent after some ``generate`` calls takes
effect exactly between them, and each result says which weight version produced it.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from spotrl_runtime.failpoints import failpoint
from spotrl_runtime.generation.backend import BackendSpec, GenerationBackend
from spotrl_runtime.generation.types import GenerationRequest, GroupFailed, GroupGenerated

if TYPE_CHECKING:
    import torch


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

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GroupGenerated | GroupFailed]:
        """One outcome per request, in order. If the batch raises, each group is retried alone so
        that one bad group fails by itself and the others still come back generated."""
        failpoint("worker.generate", self.backend.weight_version)
        try:
            return [self._stamp(r) for r in self.backend.generate(requests)]
        except Exception:
            if len(requests) == 1:
                return [GroupFailed(requests[0].group_id, traceback.format_exc(limit=8), self.worker_id)]
        outcomes: list[GroupGenerated | GroupFailed] = []
        for request in requests:
            outcomes.extend(self.generate([request]))
        return outcomes

    def load_weights(self, version: int, *parts: Mapping[str, torch.Tensor]) -> int:
        """Loads new policy weights, sent as parts of one state_dict (each its own object in
        Ray's store); returns the version now in use."""
        state_dict: dict[str, torch.Tensor] = {}
        for part in parts:
            state_dict.update(part)
        failpoint("worker.load_weights", version)
        self.backend.load_weights(state_dict, version)
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
