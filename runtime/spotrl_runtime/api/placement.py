"""Where an RLJob's GPUs go: the controller pod's, each generation worker's, each trainer
rank's. Pure arithmetic over the spec, shared by the operator (the pods' ``nvidia.com/gpu``)
and the controller (its Ray's logical GPUs, the actors' ``num_gpus``), so that what the pods
request is what the actors ask for.

- The controller pod requests ``training.resources.gpu`` (the single trainer's GPU, or the
  FSDP ranks' when they run in the pod) plus, for generation workers in the pod, ``workers``
  times ``generation.resources.gpu``.
- A generation worker with ``generation.resources.gpu`` GPUs gets that many of its own, in
  the controller pod or in its worker pod. A vLLM worker runs on exactly its
  ``tensorParallelSize`` GPUs. Without GPUs of its own in a GPU pod, a transformers worker
  shares the trainer's GPU (half of it, split between the workers); the weights then reach it
  over gloo through host memory (:mod:`~spotrl_runtime.generation.transport`).
- The single trainer's GPUs are kept out of the controller's Ray when workers in the pod have
  GPUs of their own: Ray hands its GPUs to actors, and would give the trainer's to a worker.
"""

from __future__ import annotations

from typing import Any

SHARED_GPU_FRACTION = 0.5
"""Of the trainer's GPU, what transformers workers without GPUs of their own share."""


def pod_worker_gpus(spec: Any) -> int:
    """GPUs the generation workers in the controller pod take (0 with worker pods)."""
    gen = spec.generation
    return 0 if gen.worker_pods else gen.workers * gen.resources.gpu


def controller_pod_gpus(spec: Any) -> int:
    """The controller pod's ``nvidia.com/gpu``: the trainer's and the in-pod workers'."""
    return spec.training.resources.gpu + pod_worker_gpus(spec)


def worker_gpus(spec: Any, on_gpu: bool) -> float:
    """Each generation worker actor's ``num_gpus``. ``on_gpu``: the controller pod has GPUs
    (for workers in it)."""
    gen = spec.generation
    if gen.resources.gpu:
        return float(gen.resources.gpu)
    if not gen.worker_pods and on_gpu and gen.backend == "transformers":
        return round(SHARED_GPU_FRACTION / gen.workers, 4)
    return 0.0


def ray_gpus(spec: Any, visible: int) -> int | None:
    """The logical GPUs the controller's Ray offers out of the ``visible`` ones (None: all)."""
    if pod_worker_gpus(spec) and spec.training.parallelism.strategy == "single":
        return max(0, visible - spec.training.resources.gpu)
    return None
