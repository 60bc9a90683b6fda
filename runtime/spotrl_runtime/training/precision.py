"""Mixed precision and activation checkpointing: how the trainer holds and computes its policy.

The trainer's parameters and optimizer state are always float32 (the *masters*); the forward
and backward passes compute in ``policy.dtype``. AdamW on bfloat16 weights rounds away every
update smaller than bfloat16's resolution (8 bits of mantissa: at lr 1e-6 about 1% of the
weights move at all), so a bf16 run would barely learn. Where the compute happens:

- one process: the forward runs under :func:`torch.autocast` in the compute dtype (matrix
  products in bf16, reductions and the log-softmax in fp32); the gradients land on the fp32
  parameters;
- a trainer group: FSDP2 gathers bf16 copies of the fp32 shards for each block and reduces
  the gradients in fp32 (:func:`fsdp_mixed_precision`).

Cuts hold the fp32 masters. What leaves the trainer for the generation workers, ``ckpt
export`` and ``spotrl eval`` is cast to ``policy.dtype`` (:func:`to_compute_dtype`).

float16 would need a loss scaler (its 5-bit exponent underflows small gradients); SpotRL
refuses it for training rather than train silently wrong (:data:`FLOAT16_REFUSAL`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

MASTER_DTYPE = torch.float32
"""What the trainer's parameters and optimizer state are held in, whatever ``policy.dtype`` is."""

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

FLOAT16_REFUSAL = (
    "policy.dtype: float16 is not trained by SpotRL (it needs a loss scaler, which the trainer does not "
    "have); use bfloat16, which has float32's range, or float32"
)

AC_AUTO_MIN_PARAMETERS = 100_000_000
"""``training.activationCheckpointing: auto`` turns it on for policies at least this large: every
chat model our users train. Below that (the demo policies) activations are small, and
recomputing each block in the backward pass would only cost time."""


def compute_dtype(name: str) -> torch.dtype:
    """The dtype the forward and backward passes compute in, for ``policy.dtype`` ``name``."""
    if name == "float16":
        raise ValueError(FLOAT16_REFUSAL)
    if name not in DTYPES:
        raise ValueError(f"policy.dtype: {name!r} is not one of float32, bfloat16")
    return DTYPES[name]


def autocast(device: torch.device | str, dtype: torch.dtype) -> contextlib.AbstractContextManager[Any]:
    """The compute context of one process's forward pass: autocast to ``dtype``, or nothing for
    float32 (where autocast would change nothing but add its bookkeeping)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    device_type = torch.device(device).type
    return torch.autocast(device_type=device_type, dtype=dtype)


def to_compute_dtype(state: Mapping[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """A state dict's floating-point tensors cast to ``dtype`` (integer buffers as they are): the
    weights as generation and exports receive them, at ``dtype``'s size."""
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in state.items()}


def fsdp_mixed_precision(dtype: torch.dtype) -> Any:
    """FSDP2's policy for a group of ranks: parameters gathered in ``dtype`` for compute,
    gradients reduced in float32 onto the float32 shards. None for float32 (no casts at all)."""
    if dtype == torch.float32:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def wants_activation_checkpointing(setting: str, model: torch.nn.Module) -> bool:
    """Whether ``training.activationCheckpointing`` (``auto``, ``on`` or ``off``) turns it on for ``model``."""
    if setting == "auto":
        return parameter_count(model) >= AC_AUTO_MIN_PARAMETERS
    return setting == "on"


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def enable_activation_checkpointing(model: Any) -> None:
    """Each transformer block's activations are recomputed in the backward pass instead of kept:
    transformers' own gradient checkpointing, non-reentrant (it composes with autocast and
    FSDP2, and with inputs that need no gradient)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"training.activationCheckpointing: {type(model).__name__} does not support gradient checkpointing; "
            "set it to off"
        )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
