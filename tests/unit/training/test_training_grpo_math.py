"""GRPO's advantages on hand-built rewards."""

from __future__ import annotations

import pytest
import torch

from spotrl_runtime.training.grpo import contributes, group_advantages


def test_advantages_are_reward_minus_mean_over_std() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std().item()  # Bessel: 0.5774
    expected = [0.5 / (std + 1e-6), -0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.5 / (std + 1e-6)]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)
    assert adv.sum().item() == pytest.approx(0.0, abs=1e-6)


def test_advantages_of_a_zero_variance_group_are_zero_and_it_does_not_contribute() -> None:
    assert group_advantages([0.7, 0.7, 0.7]).tolist() == [0.0, 0.0, 0.0]
    assert not contributes([0.7, 0.7, 0.7])
    assert contributes([0.7, 0.7, 0.6])


def test_advantages_need_two_rewards() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages([1.0])
