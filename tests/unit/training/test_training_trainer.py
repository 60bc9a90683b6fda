"""The Trainer on a small random Llama: micro-batching, zero-variance groups, state, determinism."""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from training_helpers import make_group, small_llama

from spotrl_runtime.core.types import FinishedGroup
from spotrl_runtime.training import Objective, Trainer, TrainerConfig


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=atol, rtol=0), name


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_micro_batches_give_the_gradient_of_one_big_batch(groups: list[FinishedGroup], kl_coef: float) -> None:
    results = []
    for micro in (64, 5, 1):  # 64 > all rollouts: one batch; 1: no padding at all
        trainer = Trainer(small_llama(), TrainerConfig(micro_batch_size=micro, kl_coef=kl_coef, temperature=0.8))
        metrics = trainer.compute_gradients(groups)
        results.append((_grads(trainer.model), metrics))
    (big, m_big), (five, m_five), (one, m_one) = results
    assert big  # the step has gradients at all
    _assert_same(big, five, atol=1e-6)
    _assert_same(big, one, atol=1e-6)
    assert m_big["loss"] == pytest.approx(m_one["loss"], abs=1e-6)
    assert m_big["tokens"] == m_five["tokens"] == m_one["tokens"]


def test_a_zero_variance_group_contributes_nothing(groups: list[FinishedGroup]) -> None:
    with_flat = Trainer(small_llama(), TrainerConfig(micro_batch_size=4))
    metrics = with_flat.compute_gradients(groups)
    without = Trainer(small_llama(), TrainerConfig(micro_batch_size=4))
    without.compute_gradients([g for g in groups if g.group_id != "c"])
    _assert_same(_grads(with_flat.model), _grads(without.model), atol=1e-7)
    assert metrics["groups_zero_variance"] == 1
    assert metrics["reward_mean"] == pytest.approx(sum(r.reward for g in groups for r in g.rollouts) / 16)


def test_a_step_of_only_flat_groups_counts_but_leaves_the_weights() -> None:
    trainer = Trainer(small_llama(), TrainerConfig(learning_rate=1e-2, weight_decay=0.1))
    before = _params(trainer.model)
    metrics = trainer.train_step([make_group("x", [1.0, 1.0]), make_group("y", [0.0, 0.0, 0.0])])
    _assert_same(before, _params(trainer.model))
    assert trainer.step == 1
    assert metrics["step"] == 1
    assert metrics["tokens"] == 0


def test_the_step_moves_probability_from_the_worse_completion_to_the_better() -> None:
    group = make_group("g", [1.0, 0.0], seed=3)
    trainer = Trainer(small_llama(), TrainerConfig(learning_rate=1e-4))

    def seq_logprob(index: int) -> float:
        r = group.rollouts[index]
        ids = torch.tensor([r.prompt_token_ids + r.completion_token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(trainer.model(ids).logits[0, :-1], -1)
        targets = ids[0, 1:]
        return float(logp[torch.arange(len(targets)), targets][len(r.prompt_token_ids) - 1 :].sum())

    good, bad = seq_logprob(0), seq_logprob(1)
    metrics = trainer.train_step([group])
    assert seq_logprob(0) > good
    assert seq_logprob(0) - seq_logprob(1) > good - bad
    assert metrics["grad_norm"] > 0
    assert metrics["learning_rate"] == 1e-4


def test_generator_logprobs_far_below_the_trainers_are_capped_by_the_importance_weight() -> None:
    """The ratio is taken against the trainer's own (proximal) log-probs, so it is 1 and never
    clipped; the gap to the generator is the importance weight, capped at every token."""
    group = make_group("g", [1.0, 0.0, 1.0, 0.0], logprob=lambda i: -30.0)
    metrics = Trainer(small_llama(), TrainerConfig(clip_epsilon=0.2, is_cap=2.0)).train_step([group])
    assert metrics["ratio_max"] == pytest.approx(1.0)
    assert metrics["clip_fraction"] == 0.0
    assert metrics["is_weight_max"] == metrics["is_weight_mean"] == 2.0
    assert metrics["is_capped_fraction"] == 1.0


def test_kl_is_zero_at_the_start_and_grows_as_the_policy_moves(groups: list[FinishedGroup]) -> None:
    trainer = Trainer(small_llama(), TrainerConfig(learning_rate=1e-2, kl_coef=0.5))
    first = trainer.train_step(groups)
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)
    later = [trainer.train_step(groups) for _ in range(3)][-1]
    assert later["kl"] > 1e-4
    # The reference did not move.
    assert trainer.reference is not None
    _assert_same(_params(trainer.reference), _params(small_llama()))


def test_training_is_deterministic_given_the_seed(groups: list[FinishedGroup]) -> None:
    runs = []
    for _ in range(2):
        trainer = Trainer(small_llama(), TrainerConfig(learning_rate=1e-3, micro_batch_size=3, seed=7))
        for _ in range(3):
            trainer.train_step(groups)
        runs.append(_params(trainer.model))
    _assert_same(runs[0], runs[1])


def test_state_dict_resumes_exactly(groups: list[FinishedGroup]) -> None:
    config = TrainerConfig(learning_rate=1e-3, weight_decay=0.01, kl_coef=0.1, micro_batch_size=4, seed=3)
    trainer = Trainer(small_llama(), config)
    trainer.train_step(groups)
    trainer.train_step(groups[:2])
    saved = copy.deepcopy(trainer.state_dict())
    expected_metrics = trainer.train_step(groups)
    expected = _params(trainer.model)

    resumed = Trainer(small_llama(), config)  # rebuilt from the same policy spec
    resumed.load_state_dict(saved)
    assert resumed.step == 2
    metrics = resumed.train_step(groups)
    _assert_same(expected, _params(resumed.model))
    assert metrics["loss"] == expected_metrics["loss"]
    assert resumed.step == 3


def test_state_dict_restores_the_rng() -> None:
    trainer = Trainer(small_llama(), TrainerConfig())
    state = trainer.state_dict()
    expected = torch.rand(3)
    torch.rand(5)  # move the generator on
    trainer.load_state_dict(state)
    assert torch.equal(torch.rand(3), expected)


def test_state_dict_of_another_format_is_refused() -> None:
    trainer = Trainer(small_llama(), TrainerConfig())
    state = trainer.state_dict()
    state["format"] = 99
    with pytest.raises(ValueError, match="format"):
        trainer.load_state_dict(state)


def test_policy_state_dict_is_a_detached_cpu_copy() -> None:
    trainer = Trainer(small_llama(), TrainerConfig(learning_rate=1e-2))
    weights = trainer.policy_state_dict()
    snapshot = {k: v.clone() for k, v in weights.items()}
    trainer.train_step([make_group("g", [1.0, 0.0])])
    _assert_same(weights, snapshot)  # later steps do not write into what was sent
    assert all(v.device.type == "cpu" and not v.requires_grad for v in weights.values())
    assert set(weights) == set(trainer.model.state_dict())


def test_mismatched_logprobs_are_an_error() -> None:
    group = make_group("g", [1.0, 0.0])
    broken = group.rollouts[0].__class__(**{**group.rollouts[0].__dict__, "logprobs": (-1.0,) * 9})
    bad = FinishedGroup("g", group.prompt, 0, (broken, group.rollouts[1]))
    with pytest.raises(ValueError, match="9 logprobs"):
        Trainer(small_llama(), TrainerConfig()).train_step([bad])


def test_warmup_ramps_the_learning_rate() -> None:
    trainer = Trainer(small_llama(), TrainerConfig(learning_rate=1e-3, warmup_steps=4))
    assert [trainer.learning_rate_at(s) for s in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])


def test_a_cosine_schedule_after_the_warmup_ends_at_zero_on_the_last_step() -> None:
    config = TrainerConfig(learning_rate=1e-3, warmup_steps=2, schedule="cosine", total_steps=6)
    rates = [config.learning_rate_at(s) for s in range(7)]
    assert rates == pytest.approx(
        [5e-4, 1e-3, 1e-3, 0.5 * (1 + math.cos(math.pi / 4)) * 1e-3, 5e-4, 1.464e-4, 0.0], abs=1e-6
    )


def test_the_spec_reaches_the_schedule_and_the_precision() -> None:
    from spotrl_runtime.api.rljob import parse_spec

    spec = parse_spec(
        {
            "policy": {"model": "builtin:tiny-arith", "dtype": "bfloat16"},
            "dataset": {"uri": "builtin:arithmetic"},
            "reward": {"name": "arithmetic_exact"},
            "training": {
                "totalSteps": 50,
                "warmupSteps": 5,
                "lrSchedule": "cosine",
                "microBatchTokens": 4096,
                "activationCheckpointing": "on",
                "clipEpsilonHigh": 0.28,
                "dualClip": 4.0,
                "importanceSamplingCap": 3.0,
                "importanceSampling": {"level": "sequence", "mode": "mask"},
                "kl": {"estimator": "k2"},
            },
        }
    )
    config = TrainerConfig.from_rljob(spec)
    assert (config.loss.is_level, config.loss.is_mode, config.loss.kl_estimator) == ("sequence", "mask", "k2")
    assert (config.warmup_steps, config.schedule, config.total_steps) == (5, "cosine", 50)
    assert (config.compute_dtype, config.activation_checkpointing, config.micro_batch_tokens) == (
        "bfloat16",
        "on",
        4096,
    )
    assert (config.loss.clip_epsilon_high, config.loss.dual_clip, config.loss.is_cap) == (0.28, 4.0, 3.0)
    assert config.learning_rate_at(4) == config.learning_rate
    assert config.learning_rate_at(30) < config.learning_rate


def test_config_from_the_rljob_spec() -> None:
    from spotrl_runtime.api.rljob import parse_spec

    spec = parse_spec(
        {
            "policy": {"model": "builtin:tiny-arith"},
            "dataset": {"uri": "builtin:arithmetic"},
            "reward": {"name": "arithmetic_exact"},
            "training": {
                "totalSteps": 5,
                "learningRate": 3e-4,
                "microBatchSize": 4,
                "klCoef": 0.05,
                "seed": 9,
                "advantage": {"normalizeByStd": False},
                "lossAggregation": "seq-mean-token-sum-norm",
                "overlong": {"filter": True, "softPenalty": {"buffer": 6, "factor": 0.5}},
                "miniBatches": 2,
                "epochs": 3,
            },
            "generation": {"temperature": 0.9, "topP": 0.85, "maxNewTokens": 24},
        }
    )
    config = TrainerConfig.from_rljob(spec)
    assert (config.learning_rate, config.micro_batch_size, config.kl_coef, config.seed) == (3e-4, 4, 0.05, 9)
    assert (config.temperature, config.top_p) == (0.9, 0.85)
    assert config.clip_epsilon == 0.2
    assert config.objective == Objective("grpo", False, "seq-mean-token-sum-norm", 24, True, (6, 0.5))
    assert (config.mini_batches, config.epochs, config.layout) == (2, 3, "miniBatches=2,epochs=3")
    namespace = SimpleNamespace(training=spec.training, generation=spec.generation, policy=spec.policy)
    assert TrainerConfig.from_rljob(namespace) == config


def _with_dropout() -> torch.nn.Module:
    """The small Llama with attention dropout: a step draws from the RNG."""
    model = small_llama()
    for m in model.modules():
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.5
    return model


DROPOUT_CONFIG = TrainerConfig(learning_rate=1e-2, micro_batch_size=4, seed=5)


def _two_steps_with_dropout(groups: list[FinishedGroup]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The weights and the second step's metrics of an undisturbed trainer: groups[:2], then groups."""
    reference = Trainer(_with_dropout(), DROPOUT_CONFIG)
    reference.train_step(groups[:2])
    metrics = reference.train_step(groups)
    return _params(reference.model), metrics


@pytest.mark.parametrize("after", [0, 2, 3])
def test_an_interrupted_step_changes_nothing_and_is_then_taken_as_if_never_begun(
    groups: list[FinishedGroup], after: int
) -> None:
    """A barrier interrupts a step between micro-batches (``after`` of 3 done, the flat group
    contributing none; 3: just before the optimizer step). Weights, optimizer, step count and
    RNG are as before it, so the step taken later is bit for bit the one an uninterrupted
    trainer takes."""
    expected, expected_metrics = _two_steps_with_dropout(groups)
    trainer = Trainer(_with_dropout(), DROPOUT_CONFIG)
    trainer.train_step(groups[:2])
    before, rng = _params(trainer.model), torch.get_rng_state()
    asked = []

    def interrupted() -> bool:
        asked.append(1)
        return len(asked) > after

    from spotrl_runtime.training.trainer import StepInterruptedError

    with pytest.raises(StepInterruptedError, match="step 1 interrupted"):
        trainer.train_step(groups, interrupted)
    assert len(asked) == after + 1
    assert trainer.step == 1
    _assert_same(before, _params(trainer.model))
    assert _grads(trainer.model) == {}
    assert torch.equal(torch.get_rng_state(), rng)
    metrics = trainer.train_step(groups)
    _assert_same(expected, _params(trainer.model))
    assert metrics["loss"] == expected_metrics["loss"]
    assert trainer.step == 2


def test_a_warm_up_changes_nothing_and_the_steps_after_it_are_bit_for_bit_the_same(
    groups: list[FinishedGroup],
) -> None:
    """The controller warms its trainer up (a forward and backward pass of dummy rows) while
    the generation workers start: weights, gradients, optimizer, step count and RNG stay as they
    were, so the run trains exactly as it would have without it (dropout draws included)."""
    expected, expected_metrics = _two_steps_with_dropout(groups)
    trainer = Trainer(_with_dropout(), DROPOUT_CONFIG)
    before, rng = _params(trainer.model), torch.get_rng_state()
    seconds = trainer.warm_up(rows=3, tokens=12)
    assert seconds >= 0
    _assert_same(before, _params(trainer.model))
    assert _grads(trainer.model) == {}
    assert trainer.optimizer.state_dict()["state"] == {}
    assert trainer.step == 0
    assert torch.equal(torch.get_rng_state(), rng)
    assert not trainer.model.training, "back in eval mode, as between steps"
    trainer.train_step(groups[:2])
    trainer.warm_up()  # between steps too (a resumed trainer warms up after its restore)
    metrics = trainer.train_step(groups)
    _assert_same(expected, _params(trainer.model))
    assert metrics["loss"] == expected_metrics["loss"]


def _as_generated(model: torch.nn.Module, group: FinishedGroup, version: int, shift: float = 0.0) -> FinishedGroup:
    """``group`` as a generator holding ``model``'s weights would have produced it (its log-probs,
    plus ``shift``), stamped with weight version ``version``."""
    from dataclasses import replace

    from spotrl_runtime.training.logprobs import full_softmax_logprobs, token_batch

    rollouts = []
    for r in group.rollouts:
        with torch.no_grad():
            lp = full_softmax_logprobs(
                model, token_batch([(r.prompt_token_ids, r.completion_token_ids)], 0, "cpu"), 1.0
            )
        rollouts.append(replace(r, logprobs=tuple(float(x) + shift for x in lp), weight_version=version))
    return replace(group, rollouts=tuple(rollouts))


def test_the_rollout_probs_diff_measures_the_generator_against_the_trainer() -> None:
    """Rows generated with the trainer's own weights: ~0; the same rows with log-probs that are
    off (a sync that did not arrive) show it; rows generated ahead, with older weights, are
    not compared (they differ by design)."""
    model = small_llama()
    raw = [make_group(f"g{i}", [1.0, 0.0, 0.5]) for i in range(3)]
    same = [_as_generated(model, g, version=0) for g in raw]
    metrics = Trainer(copy.deepcopy(model), TrainerConfig()).train_step(same)
    assert metrics["rollout_probs_diff_tokens"] == metrics["tokens"] > 0
    assert metrics["rollout_probs_diff_max"] < 1e-5

    off = [_as_generated(model, g, version=0, shift=-0.7) for g in raw]
    metrics = Trainer(copy.deepcopy(model), TrainerConfig()).train_step(off)
    assert metrics["rollout_probs_diff_max"] > 0.05
    assert metrics["rollout_probs_diff_mean"] > 0.01

    ahead = [_as_generated(model, g, version=5, shift=-0.7) for g in raw]
    metrics = Trainer(copy.deepcopy(model), TrainerConfig()).train_step(ahead)
    assert "rollout_probs_diff_max" not in metrics


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_sequence_masked_correction_leaves_out_a_rollout_the_generator_sampled_far_off(dtype: str) -> None:
    """One rollout's generator log-probs far below the trainer's (a ratio far above the cap):
    masked per sequence, the step's update is the one of the other rollouts alone."""
    model = small_llama()
    group = make_group("g", [1.0, 0.0, 0.0, 1.0])
    off = replace(
        group,
        rollouts=(
            replace(group.rollouts[0], logprobs=tuple(x - 3.0 for x in group.rollouts[0].logprobs)),
            *group.rollouts[1:],
        ),
    )
    config = TrainerConfig(compute_dtype=dtype, is_cap=2.0, is_level="sequence", is_mode="mask", micro_batch_size=4)
    masked = Trainer(copy.deepcopy(model), config).train_step([off])
    truncated = Trainer(copy.deepcopy(model), replace(config, is_mode="truncate")).train_step([off])
    assert math.isfinite(masked["loss"])
    assert math.isfinite(truncated["loss"])
    assert masked["is_capped_fraction"] > 0
    assert masked["is_weight_max"] < truncated["is_weight_max"] == pytest.approx(2.0)


def test_a_wrong_behaviour_logprob_changes_the_loss_through_the_importance_weight() -> None:
    """Rows whose generator log-probs are 0.7 below the trainer's weigh min(e^0.7, 2) = 2 each,
    fresh or one version stale; with the weight left out they would train as if they were right."""
    model = small_llama()
    raw = [make_group(f"g{i}", [1.0, 0.0, 0.5]) for i in range(3)]
    right = Trainer(copy.deepcopy(model), TrainerConfig(is_cap=2.0)).train_step(
        [_as_generated(model, g, 0) for g in raw]
    )
    for version in (0, -1):  # -1: generated one version before the step's weights (lookahead 1)
        off = [_as_generated(model, g, version=version, shift=-0.7) for g in raw]
        capped = Trainer(copy.deepcopy(model), TrainerConfig(is_cap=2.0)).train_step(off)
        unweighted = Trainer(copy.deepcopy(model), TrainerConfig(is_cap=None)).train_step(off)
        assert capped["policy_loss"] == pytest.approx(2.0 * right["policy_loss"], rel=1e-5)
        assert unweighted["policy_loss"] == pytest.approx(right["policy_loss"], rel=1e-5)
        assert capped["is_capped_fraction"] == 1.0
        assert capped["clip_fraction"] == 0.0
    assert "rollout_probs_diff_stale_max" in capped
    assert "rollout_probs_diff_max" not in capped


def test_the_entropy_of_a_uniform_policy_and_of_the_chunked_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """log V nats a position where the head gives every token the same logit; otherwise the
    chunked path's entropies equal the full softmax's, at any chunk size."""
    from training_helpers import VOCAB

    from spotrl_runtime.training import logprobs as lp

    groups = [make_group("a", [1.0, 0.0, 0.5])]
    model = small_llama()
    batch = lp.token_batch([(r.prompt_token_ids, r.completion_token_ids) for r in groups[0].rollouts], 0, "cpu")
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention).logits[batch.rows, batch.positions]
        logp = torch.log_softmax(logits / 0.7, -1)
        expected = -(logp.exp() * logp).sum(-1)
        _, whole = lp.token_logprobs(model, batch, 0.7)
        monkeypatch.setattr(lp, "LOGITS_CHUNK_ELEMENTS", VOCAB * 2)  # two positions a chunk
        _, chunked = lp.token_logprobs(model, batch, 0.7)
        assert torch.allclose(whole, expected, atol=1e-6)
        assert torch.allclose(chunked, expected, atol=1e-6)
        model.lm_head.weight.zero_()  # tied: the embeddings too; every logit is 0
        _, uniform = lp.token_logprobs(model, batch, 1.0)
    assert uniform.tolist() == pytest.approx([math.log(VOCAB)] * batch.targets.numel())
