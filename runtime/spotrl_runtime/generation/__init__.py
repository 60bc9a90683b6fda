"""Generation behind one interface: a transformers backend (CPU) and vLLM (GPU), as Ray workers.

vLLM and Ray are imported only where they are used, so this package imports on a machine that
has neither (the GPU check script, the trainer process).
"""

from spotrl_runtime.generation.backend import BackendSpec, GenerationBackend
from spotrl_runtime.generation.rollouts import encode_prompt, group_seed, make_request, score_group
from spotrl_runtime.generation.sampling import sampling_logprobs
from spotrl_runtime.generation.types import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationRequest,
    GroupFailed,
    GroupGenerated,
    GroupLost,
    GroupOutcome,
    Sample,
    TurnsFinished,
)
from spotrl_runtime.generation.worker import build_backend

__all__ = [
    "FINISH_LENGTH",
    "FINISH_STOP",
    "BackendSpec",
    "GenerationBackend",
    "GenerationRequest",
    "GroupFailed",
    "GroupGenerated",
    "GroupLost",
    "GroupOutcome",
    "Sample",
    "TurnsFinished",
    "build_backend",
    "encode_prompt",
    "group_seed",
    "make_request",
    "sampling_logprobs",
    "score_group",
]
