"""One way the generation tests start vLLM's CPU build in the test process."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from spotrl_runtime.generation.vllm_backend import VLLMBackend
from spotrl_runtime.models import resolve_model_dir


def cpu_engine(tmp_path_factory: pytest.TempPathFactory, model: str, dtype: str, **options: Any) -> VLLMBackend:
    """``model`` on vLLM's CPU build, one thread, 16-token KV blocks (the tiny policies' contexts
    never fill vLLM's default 128-token block, and prefix caching reuses whole blocks only), with
    an empty vLLM cache: the engine then inspects the model's class in this process, where vLLM's
    inspection subprocess, were it started, would fail."""
    from vllm.model_executor.models import registry

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm-cache")))
        mp.setattr(registry, "_SUBPROCESS_COMMAND", [sys.executable, "-c", "raise SystemExit(3)"])
        return VLLMBackend(
            str(resolve_model_dir(model)), dtype=dtype, device="cpu", threads=1, block_size=16, **options
        )
