"""The trainer group (FSDP2 ranks as Ray actors, gloo on CPU) against the single process.

Same policy, same seed, same groups: after 5 steps the loss curve and the weights must agree.
Tolerances: the ranks add up the same gradient in another order (FSDP's reduce-scatter, the
micro-batches of each share), so float32 rounding differs; 5 AdamW steps keep that at about
1e-6 relative. A wrong gradient scale (say, FSDP's average not undone) moves the weights by
the learning rate, 1e-3: far outside.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from training_helpers import make_group

from spotrl_runtime.models import load_policy
from spotrl_runtime.training import Trainer, TrainerConfig
from spotrl_runtime.training.group import RankLostError, TrainerGroup

pytestmark = pytest.mark.slow

POLICY = "builtin:tiny-arith"
STEPS = 5
TOL = {"rtol": 1e-4, "atol": 2e-6}


def steps_of_groups() -> list[list[Any]]:
    """Five steps of four groups each: uneven lengths, one group per step without variance."""
    out = []
    for step in range(STEPS):
        out.append(
            [
                make_group(f"s{step}-a", [1.0, 0.0, 0.0, 1.0], seed=step),
                make_group(f"s{step}-b", [0.0, 0.5, 1.0, 0.0], seed=step),
                make_group(f"s{step}-c", [1.0, 1.0, 1.0, 1.0], seed=step),
                make_group(f"s{step}-d", [0.25, 0.0, 0.75, 1.0], seed=step, logprob=lambda i: -0.5 - 0.1 * i),
            ]
        )
    return out


def config(**kw: Any) -> TrainerConfig:
    return TrainerConfig(**{"learning_rate": 1e-3, "micro_batch_size": 3, "max_grad_norm": 0.5, "seed": 7, **kw})


def run_single(cfg: TrainerConfig) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    model, _ = load_policy(POLICY)
    trainer = Trainer(model, cfg)
    metrics = [trainer.train_step(groups) for groups in steps_of_groups()]
    return metrics, trainer.policy_state_dict()


@pytest.mark.parametrize("kl_coef", [0.0, 0.1], ids=["no-kl", "kl"])
def test_two_fsdp_ranks_train_what_one_process_trains(ray_session: Any, kl_coef: float) -> None:
    cfg = config(kl_coef=kl_coef)
    single_metrics, single_weights = run_single(cfg)
    group = TrainerGroup(POLICY, cfg, ranks=2, cpus_per_rank=0.5)
    try:
        group.start(timeout=120)
        assert len(set(group.pids)) == 2, "two processes"
        group_metrics = [group.train_step(groups) for groups in steps_of_groups()]
        weights = group.policy_state_dict()
    finally:
        group.shutdown()
    assert group.step == STEPS
    for one, two in zip(single_metrics, group_metrics, strict=True):
        for key in ("loss", "policy_loss", "kl", "tokens", "groups_zero_variance", "grad_norm", "clip_fraction"):
            assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), (key, one, two)
    assert single_metrics[0]["tokens"] > 0
    assert single_metrics[-1]["grad_norm"] > 0
    assert set(weights) == set(single_weights)
    moved = 0.0
    initial, _ = load_policy(POLICY)
    for name, w in initial.state_dict().items():
        torch.testing.assert_close(weights[name], single_weights[name], **TOL, msg=name)
        moved = max(moved, float((single_weights[name] - w).abs().max()))
    assert moved > 1e-3, "the steps moved the weights (else parity proves nothing)"


def test_a_rank_killed_mid_run_fails_the_step_as_rank_lost(ray_session: Any) -> None:
    import os
    import signal

    group = TrainerGroup(POLICY, config(), ranks=2, cpus_per_rank=0.5)
    try:
        group.start(timeout=120)
        steps = steps_of_groups()
        group.train_step(steps[0])
        os.kill(group.pids[1], signal.SIGKILL)
        with pytest.raises(RankLostError, match="trainer rank was lost"):
            group.train_step(steps[1])
    finally:
        group.shutdown()
