"""The one generation interface, and the picklable spec a worker builds its backend from
(:func:`~spotrl_runtime.generation.worker.build_backend`)."""

from __future__ import annotations

import traceback
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from spotrl_runtime.generation.types import GenerationRequest, GroupFailed, GroupGenerated

if TYPE_CHECKING:
    from spotrl_runtime.api.rljob import Environment, Lora
    from spotrl_runtime.generation.weights import ChannelAddress, SyncPlan


class GenerationBackend(ABC):
    """Generates groups of samples with one set of policy weights at a time.

    ``weight_version`` is the version last received (0: the initial weights); every
    :class:`GroupGenerated` carries the version that produced all its samples. New weights come
    over the weight channel (:mod:`~spotrl_runtime.generation.weights`): the worker joins the
    channel's group of an epoch, then receives a version bucket by bucket.
    """

    weight_version: int = 0
    batch_groups: int = 8
    """The batched path (:meth:`step`'s default): groups generated together at most."""

    @abstractmethod
    def generate(self, requests: Sequence[GenerationRequest]) -> list[GroupGenerated]:
        """One result per request, in order. Raises if the batch cannot be generated."""

    # The streaming interface a worker drives (:class:`~.worker.GenerationWorker`): groups are
    # started as they arrive and come back from :meth:`step` as each one finishes. The default
    # is the batched path: each step generates the next ``batch_groups`` waiting groups
    # together. vLLM overrides it with its engine's own requests (continuous batching).

    def start(self, requests: Iterable[GenerationRequest]) -> None:
        """Starts generating ``requests`` with the current weights (they finish in later steps)."""
        self._waiting().extend(requests)

    def step(self) -> list[GroupGenerated | GroupFailed]:
        """Advances generation; returns the groups that finished (or failed) in this step.
        A batch that raises is retried group by group, so that a bad group fails alone."""
        waiting = self._waiting()
        batch, waiting[:] = waiting[: self.batch_groups], waiting[self.batch_groups :]
        return self._generate_each(batch)

    def unfinished(self) -> int:
        """Groups started and not yet returned by :meth:`step`."""
        return len(self._waiting())

    def abort(self) -> list[str]:
        """Stops every unfinished group at once; returns their ids (they never come back from
        :meth:`step`)."""
        waiting = self._waiting()
        ids = [r.group_id for r in waiting]
        waiting.clear()
        return ids

    def _waiting(self) -> list[GenerationRequest]:
        if "_waiting_list" not in self.__dict__:
            self._waiting_list: list[GenerationRequest] = []
        return self._waiting_list

    def _generate_each(self, batch: list[GenerationRequest]) -> list[GroupGenerated | GroupFailed]:
        if not batch:
            return []
        try:
            return list(self.generate(batch))
        except Exception:
            if len(batch) == 1:
                return [GroupFailed(batch[0].group_id, traceback.format_exc(limit=8), "")]
        return [outcome for request in batch for outcome in self._generate_each([request])]

    @abstractmethod
    def join_channel(self, address: ChannelAddress) -> None:
        """Joins the weight channel's group of ``address.epoch`` (unless already in it)."""

    @abstractmethod
    def receive_weights(self, plan: SyncPlan, version: int) -> int:
        """Receives ``version`` over the channel and loads it in place, bucket by bucket (names as
        in the trainer's ``state_dict()``); returns the bytes received. Raises
        :class:`~spotrl_runtime.generation.weights.WeightSyncError` if it did not all arrive: the
        weights are then torn, and the backend must not generate before a whole version."""

    def context_tokens(self) -> int | None:
        """The longest context (prompt and completion) the engine takes, if it has a bound."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases what the backend holds (GPU memory, engine processes)."""


@dataclass(frozen=True)
class BackendSpec:
    """What a generation worker needs to build its backend; picklable, so it travels to Ray actors."""

    kind: Literal["transformers", "vllm"]
    model: str
    """``spec.policy.model``: builtin:<name>, a local folder or an s3:// URI."""
    dtype: str = "float32"
    device: str = "cpu"
    """The torch device; for vLLM, "cpu" (its CPU build) or "cuda" (the GPU Ray gives the worker)."""
    torch_threads: int = 0
    """On the CPU: the worker's threads (torch's intra-op pool, which vLLM's CPU kernels use too);
    0 leaves torch's default."""
    max_batch_rows: int = 256
    """transformers: samples decoded together at most (groups are never split)."""
    gpu_memory_utilization: float = 0.85
    kv_cache_bytes: int | None = None
    """vLLM: the KV cache's size (on the CPU build, None means the backend's default)."""
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    seed: int = 0
    lora: Lora | None = None
    """``spec.policy.lora``: the base is served once, with the trainer's adapter on it."""
    max_loras: int = 2
    """vLLM with LoRA: adapter versions served at once (``generation.lookahead`` + 2)."""
    environment: Environment | None = None
    """``spec.environment``: each sample an episode of turns against it
    (:class:`~spotrl_runtime.rollouts.episodes.EpisodeBackend` around the engine)."""

    @classmethod
    def from_rljob(cls, spec: Any, *, device: str | None = None) -> BackendSpec:
        """The spec for ``RLJob.spec``'s generation backend and policy, on ``device``."""
        from spotrl_runtime.api.rljob import quantity_value

        gen = spec.generation
        device = device or "cpu"
        on_gpu = device.startswith("cuda")
        return cls(
            kind=gen.backend,
            model=spec.policy.model,
            dtype=_vllm_dtype(spec.policy.dtype) if gen.backend == "vllm" and on_gpu else spec.policy.dtype,
            device=device,
            torch_threads=0 if on_gpu else gen.worker_threads(),
            gpu_memory_utilization=gen.gpu_memory_utilization,
            kv_cache_bytes=int(quantity_value(gen.kv_cache_memory)) if gen.kv_cache_memory else None,
            max_model_len=gen.max_model_len,
            tensor_parallel_size=gen.tensor_parallel_size if on_gpu else 1,
            seed=spec.training.seed,
            lora=spec.policy.lora,
            max_loras=gen.lookahead + 2,
            environment=spec.environment,
        )


def _vllm_dtype(trainer_dtype: str) -> str:
    # On GPUs the trainer's float32 master weights are served in bfloat16 by vLLM. On the CPU
    # vLLM serves the trainer's dtype, and its log-probs match the trainer's to ~1e-6.
    return "bfloat16" if trainer_dtype == "float32" else trainer_dtype
