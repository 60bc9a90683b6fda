"""GRPO training in plain torch: the pure loss arithmetic and the :class:`Trainer`."""

from spotrl_runtime.training.grpo import (
    LossTerms,
    completion_logprobs,
    contributes,
    group_advantages,
    token_loss_terms,
)
from spotrl_runtime.training.trainer import Trainer, TrainerConfig

__all__ = [
    "LossTerms",
    "Trainer",
    "TrainerConfig",
    "completion_logprobs",
    "contributes",
    "group_advantages",
    "token_loss_terms",
]
