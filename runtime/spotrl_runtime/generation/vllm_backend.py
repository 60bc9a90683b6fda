"""Generation with vLLM (``vllm.LLM``) on one GPU: the production path. Written against vLLM 0.24.

- The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so new weights go
  from the Ray object store to the GPU without another copy through an engine process.
- Each group is one prompt with ``SamplingParams(n=G, seed=...)``; all groups of a call are
  handed to one ``llm.generate`` so vLLM batches them.
- ``logprobs_mode="processed_logprobs"`` makes the returned log-probs those of the distribution
  actually sampled from (after temperature and top-p), like the transformers backend's.
- Weights are reloaded in place with the worker's ``reload_weights`` (checkpoint-format names,
  as in the trainer's ``state_dict()``), then the prefix cache is reset: cached KV blocks were
  computed with the old weights.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from spotrl_runtime.generation.backend import BackendSpec, GenerationBackend
from spotrl_runtime.generation.types import FINISH_LENGTH, FINISH_STOP, GenerationRequest, GroupGenerated, Sample

if TYPE_CHECKING:
    import torch


def vllm_available() -> bool:
    """Whether vLLM can be imported here (it is not installed on CPU-only machines)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


class VLLMBackend(GenerationBackend):
    """One ``vllm.LLM`` engine on the GPU this process was given."""

    def __init__(
        self,
        model_dir: str,
        *,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float = 0.85,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        seed: int = 0,
    ) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            import vllm
        except ImportError as err:
            raise RuntimeError(
                "generation.backend 'vllm' needs the vllm package (pip install 'spotrl[gpu]') on a GPU node; "
                "use backend 'transformers' on CPU-only machines"
            ) from err
        from transformers import AutoTokenizer

        self._vllm = vllm
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        options: dict[str, Any] = {"max_model_len": max_model_len} if max_model_len else {}
        self.llm = vllm.LLM(
            model=model_dir,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            seed=seed,
            logprobs_mode="processed_logprobs",
            **options,
        )
        self.weight_version = 0

    @classmethod
    def from_spec(cls, spec: BackendSpec) -> VLLMBackend:
        """Resolves ``spec.model`` to a local folder (building or downloading it) and starts vLLM."""
        from spotrl_runtime.models import resolve_model_dir

        model_dir = resolve_model_dir(spec.model)
        return cls(
            str(model_dir),
            dtype=spec.dtype,
            gpu_memory_utilization=spec.gpu_memory_utilization,
            max_model_len=spec.max_model_len,
            enforce_eager=spec.enforce_eager,
            seed=spec.seed,
        )

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GroupGenerated]:
        started = time.monotonic()
        version = self.weight_version
        prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests]
        params = [
            self._vllm.SamplingParams(
                n=r.n,
                max_tokens=r.max_new_tokens,
                temperature=r.temperature,
                top_p=r.top_p,
                seed=r.seed,
                logprobs=0,  # only the sampled token's log-prob
                detokenize=False,  # we decode with the same tokenizer as the trainer
            )
            for r in requests
        ]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        seconds = time.monotonic() - started
        results = []
        for request, output in zip(requests, outputs, strict=True):
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
            results.append(
                GroupGenerated(
                    group_id=request.group_id,
                    prompt_token_ids=request.prompt_token_ids,
                    samples=tuple(samples),
                    weight_version=version,
                    seconds=seconds,
                )
            )
        return results

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": list(state_dict.items()), "is_checkpoint_format": True}
        )
        self.llm.reset_prefix_cache()
        self.weight_version = version

    def close(self) -> None:
        del self.llm


def _sampled_logprobs(ids: tuple[int, ...], logprobs: Any) -> tuple[float, ...]:
    """The sampled token's log-prob at each position (vLLM returns one dict per position)."""
    if logprobs is None or len(logprobs) != len(ids):
        raise RuntimeError(
            f"vLLM returned {0 if logprobs is None else len(logprobs)} logprob entries for {len(ids)} tokens"
        )
    return tuple(float(position[token].logprob) for token, position in zip(ids, logprobs, strict=True))
