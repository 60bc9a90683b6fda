"""The GPU paths: vLLM and the transformers backend on CUDA.

These skip on machines without CUDA (the vLLM ones also without vLLM's CUDA build, which the
``gpu`` extra installs); the CPU suite covers the transformers path in full, and vLLM's CPU
build in test_vllm_cpu.py. Run them on a
GPU machine with ``pytest tests/integration/generation/test_generation_gpu.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from spotrl_runtime.generation import GenerationRequest, sampling_logprobs
from spotrl_runtime.generation.transformers_backend import TransformersBackend
from spotrl_runtime.generation.weights import give_weights
from spotrl_runtime.models import load_policy, resolve_model_dir
from spotrl_runtime.vllm_build import vllm_build

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
needs_vllm = pytest.mark.skipif(
    not (torch.cuda.is_available() and vllm_build() == "cuda"),
    reason="needs vLLM's CUDA build (extra `gpu`) and a CUDA device; the CPU build's tests: test_vllm_cpu.py",
)

PROMPTS = ["3+4=", "9-2=", "7+8=", "5+5="]


def _requests(tok: Any, n: int = 8) -> list[GenerationRequest]:
    return [GenerationRequest(f"g{i}", tuple(tok(p)["input_ids"]), n, 8, seed=i) for i, p in enumerate(PROMPTS)]


def _gap(model: Any, results: list[Any]) -> float:
    worst = 0.0
    for r in results:
        for s in r.samples:
            ids = torch.tensor([r.prompt_token_ids + s.completion_token_ids], device="cuda")
            with torch.no_grad():
                logits = model(ids).logits[0, len(r.prompt_token_ids) - 1 : -1].float()
            n = logits.shape[0]
            dist = sampling_logprobs(logits, torch.ones(n, device="cuda"), torch.ones(n, device="cuda"))
            expected = dist[torch.arange(n), ids[0, len(r.prompt_token_ids) :]].cpu()
            worst = max(worst, float((torch.tensor(s.logprobs) - expected).abs().max()))
    return worst


@needs_cuda
def test_transformers_backend_on_cuda() -> None:
    model, tok = load_policy("builtin:tiny-arith", "cuda")
    backend = TransformersBackend(model, tok)
    results = backend.generate(_requests(tok))
    assert all(len(r.samples) == 8 for r in results)
    assert _gap(model, results) < 1e-3


@needs_vllm
def test_vllm_backend_samples_logprobs_and_reload() -> None:
    from spotrl_runtime.generation.vllm_backend import VLLMBackend

    engine = VLLMBackend(str(resolve_model_dir("builtin:tiny-arith")), dtype="float32", gpu_memory_utilization=0.2)
    reference, tok = load_policy("builtin:tiny-arith", "cuda")
    try:
        results = engine.generate(_requests(tok))
        assert [r.group_id for r in results] == [f"g{i}" for i in range(len(PROMPTS))]
        assert all(len(r.samples) == 8 and r.weight_version == 0 for r in results)
        for s in (s for r in results for s in r.samples):
            assert len(s.logprobs) == len(s.completion_token_ids)
            if s.finish_reason == "stop":
                assert s.completion_token_ids[-1] == tok.eos_token_id
        assert _gap(reference, results) < 5e-3

        generator = torch.Generator().manual_seed(0)
        moved = {
            k: v + 0.3 * torch.randn(v.shape, generator=generator) if "norm" not in k else v
            for k, v in reference.cpu().state_dict().items()
        }
        give_weights(engine, moved, version=4)
        reference.load_state_dict(moved)
        reference.to("cuda")
        after = engine.generate(_requests(tok))
        assert all(r.weight_version == 4 for r in after)
        assert _gap(reference, after) < 5e-3  # the engine follows the new weights
    finally:
        engine.close()
