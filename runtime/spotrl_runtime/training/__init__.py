"""RL training in plain torch: advantages, losses, the step and the :class:`Trainer`."""

from spotrl_runtime.training.advantages import Objective, contributes, group_advantages
from spotrl_runtime.training.losses import LossConfig, LossTerms, token_loss_terms
from spotrl_runtime.training.trainer import Trainer, TrainerConfig

__all__ = [
    "LossConfig",
    "LossTerms",
    "Objective",
    "Trainer",
    "TrainerConfig",
    "contributes",
    "group_advantages",
    "token_loss_terms",
]
