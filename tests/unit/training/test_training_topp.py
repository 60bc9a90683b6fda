"""The trainer's log-probs under generation's top-p: one sampling distribution for both.

With ``generation.topP < 1`` the generator's log-probs are renormalised over the top-p nucleus;
the trainer's must be too, or every importance weight is off by the nucleus' mass. The tests
here: the chunked path equals the plain one under top-p (values, gradients, entropies), a token
outside the trainer's nucleus is left out of the loss and counted (never a NaN), and a trainer
fed the transformers backend's samples at ``topP: 0.9`` agrees with it (and would not under the
full softmax). vLLM's: tests/integration/generation/test_vllm_cpu.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from training_helpers import small_llama

from spotrl_runtime.core.types import FinishedGroup, Prompt
from spotrl_runtime.generation import GenerationRequest, sampling_logprobs, score_group
from spotrl_runtime.generation.transformers_backend import TransformersBackend
from spotrl_runtime.training import Trainer, TrainerConfig, precision
from spotrl_runtime.training import logprobs as lp
from spotrl_runtime.training.losses import LossConfig, Tokens, token_loss_terms


def _grad(t: torch.Tensor) -> torch.Tensor:
    assert t.grad is not None
    return t.grad


def _batch(vocab: int) -> lp.TokenBatch:
    g = torch.Generator().manual_seed(0)
    pairs = []
    for prompt_len, completion_len in [(3, 7), (6, 2), (2, 11), (5, 5)]:
        ids = torch.randint(3, vocab, (prompt_len + completion_len,), generator=g).tolist()
        pairs.append((ids[:prompt_len], ids[prompt_len:]))
    return lp.token_batch(pairs, 0, "cpu")


def test_the_chunked_logprobs_under_top_p_equal_the_plain_ones_in_value_and_gradient(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = small_llama()
    batch = _batch(model.config.vocab_size)
    weights = torch.randn(batch.targets.shape, generator=torch.Generator().manual_seed(1))
    full = lp.full_softmax_logprobs(model, batch, 0.8, 0.7)
    inside = torch.isfinite(full)
    assert 0 < int(inside.sum()) < inside.numel(), "random targets: some inside the nucleus, some not"
    torch.where(inside, full * weights, 0.0).sum().backward()
    expected = {n: _grad(p).clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    # Three positions a chunk under top-p (the chunk halves): several chunks, the last one short.
    monkeypatch.setattr(lp, "LOGITS_CHUNK_ELEMENTS", model.config.vocab_size * 6)
    chunked, _ = lp.call(model, batch, 0.8, 0.7)
    torch.where(inside, chunked * weights, 0.0).sum().backward()
    assert torch.equal(torch.isfinite(chunked), inside)
    assert torch.allclose(chunked[inside], full[inside], atol=1e-6, rtol=0)
    for name, param in model.named_parameters():
        assert torch.isfinite(_grad(param)).all(), name
        # fp32 rounding: sums taken in another order
        assert float((_grad(param) - expected[name]).abs().max()) <= 2e-5 * float(expected[name].abs().max()), name


def test_in_bf16_the_chunked_path_takes_the_nucleus_of_the_same_bf16_logits() -> None:
    model = small_llama()
    batch = _batch(model.config.vocab_size)
    with torch.no_grad(), precision.autocast("cpu", torch.bfloat16):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention).logits[batch.rows, batch.positions]
        chunked, _ = lp.call(model, batch, 1.0, 0.9)
    assert logits.dtype == torch.bfloat16
    expected = sampling_logprobs(logits, 1.0, 0.9).gather(-1, batch.targets[:, None])[:, 0]
    assert torch.equal(torch.isfinite(chunked), torch.isfinite(expected))
    finite = torch.isfinite(expected)
    assert torch.allclose(chunked[finite], expected[finite], atol=1e-6, rtol=0)


def test_the_entropy_is_the_nucleus_distributions() -> None:
    model = small_llama()
    batch = _batch(model.config.vocab_size)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention).logits[batch.rows, batch.positions]
        nucleus = sampling_logprobs(logits, 0.8, 0.6)
        p = nucleus.exp()
        expected = -(p * torch.where(p > 0, nucleus, 0.0)).sum(-1)
        _, entropy = lp.call(model, batch, 0.8, 0.6)
        _, full = lp.call(model, batch, 0.8, 1.0)
    assert torch.isfinite(entropy).all()
    assert torch.allclose(entropy, expected, atol=1e-6, rtol=0)
    assert bool((entropy < full).all()), "a nucleus of fewer tokens has less entropy than the whole softmax"


def _tokens_with_one_outside(reference: torch.Tensor | None = None) -> tuple[Tokens, torch.Tensor]:
    """Four trained tokens of one position's real nucleus (top-p 0.95 of four logits); the third
    is outside it (-inf). Returns the tokens and the logits leaf the log-probs come from."""
    logits = torch.tensor([[3.0, 2.0, -1.0, 0.5]] * 4, requires_grad=True)
    dist = sampling_logprobs(logits, 1.0, 0.95)
    logprobs = dist.gather(-1, torch.tensor([[0], [1], [2], [3]]))[:, 0]
    assert torch.isinf(logprobs[2])
    assert torch.isfinite(logprobs[[0, 1, 3]]).all()
    # The generator's: close to the trainer's, and every token it sampled had p > 0 (e^-3 the third).
    behaviour = torch.where(torch.isfinite(logprobs), logprobs.detach() - 0.01, -3.0)
    tokens = Tokens(
        logprobs=logprobs,
        proximal=logprobs.detach(),
        behaviour=behaviour,
        advantages=torch.tensor([1.0, -1.0, 1.0, 0.5]),
        fresh=torch.ones(4, dtype=torch.bool),
        reference=reference,
    )
    return tokens, logits


def test_a_token_outside_the_trainers_nucleus_is_left_out_of_the_loss_and_counted() -> None:
    tokens, logits = _tokens_with_one_outside()
    terms = token_loss_terms(tokens, LossConfig(is_cap=2.0))
    terms.loss_sum.backward()
    assert torch.isfinite(terms.loss_sum)
    assert torch.isfinite(_grad(logits)).all()
    assert terms.outside_nucleus == 1
    assert terms.tokens == 4
    # Its weight is 0: the loss is that of the other three alone.
    kept = [0, 1, 3]
    alone = Tokens(
        logprobs=tokens.logprobs[kept],
        proximal=tokens.proximal[kept],
        behaviour=tokens.behaviour[kept],
        advantages=tokens.advantages[kept],
        fresh=tokens.fresh[kept],
    )
    expected = token_loss_terms(alone, LossConfig(is_cap=2.0)).loss_sum
    assert float(terms.loss_sum.detach()) == pytest.approx(float(expected.detach()))
    assert terms.is_weight_max <= 2.0
    # The gap check sees it: p_trainer = 0 against the generator's e^-3.
    assert terms.probs_diff_tokens == 4
    assert terms.probs_diff_max == pytest.approx(float(torch.tensor(-3.0).exp()))


def test_a_token_outside_the_references_nucleus_is_left_out_of_the_kl_term_alone() -> None:
    reference = torch.tensor([-0.5, float("-inf"), -2.0, -1.0])
    tokens, logits = _tokens_with_one_outside(reference)
    terms = token_loss_terms(tokens, LossConfig(kl_coef=0.1))
    terms.loss_sum.backward()
    assert torch.isfinite(terms.loss_sum)
    assert torch.isfinite(torch.tensor(terms.kl_sum))
    assert torch.isfinite(_grad(logits)).all()
    d0, d3 = (reference[i] - tokens.logprobs[i].detach() for i in (0, 3))
    assert terms.kl_sum == pytest.approx(float(d0.exp() - d0 - 1 + d3.exp() - d3 - 1))


# ---------------------------------------------------------------- against the transformers backend


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any, list[FinishedGroup]]:
    """The demo policy, its tokenizer, and groups the transformers backend sampled from it at
    top-p 0.9, rewarded so that every group trains (generated once for the module)."""
    from spotrl_runtime.models import load_policy

    model, tok = load_policy("builtin:tiny-arith")
    backend = TransformersBackend(copy.deepcopy(model), tok)
    prompts = ["3+4=", "9-2=", "7+8=", "5+5="]
    requests = [
        GenerationRequest(f"g{i}", tuple(tok(p)["input_ids"]), 6, 6, temperature=1.0, top_p=0.9, seed=i)
        for i, p in enumerate(prompts)
    ]
    groups = [
        score_group(r, Prompt(i, prompts[i], prompts[i], ""), [float(j % 2) for j in range(6)], 0)
        for i, r in enumerate(backend.generate(requests))
    ]
    return model, tok, groups


GAP_BOUND = 1e-5
"""float32, one model, one function: the generator's and the trainer's probabilities agree to rounding."""


def test_the_trainer_agrees_with_the_transformers_backend_at_top_p(tiny: tuple[Any, Any, Any]) -> None:
    model, _, groups = tiny
    same = Trainer(copy.deepcopy(model), TrainerConfig(top_p=0.9)).train_step(groups)
    assert same["rollout_probs_diff_tokens"] == same["tokens"] > 0
    assert same["rollout_probs_diff_max"] < GAP_BOUND
    assert same["outside_nucleus_fraction"] == 0.0
    # The full softmax (the trainer before top-p) misses the nucleus' renormalisation.
    full = Trainer(copy.deepcopy(model), TrainerConfig(top_p=1.0)).train_step(groups)
    print(
        f"tiny-arith top-p 0.9: probs diff max {same['rollout_probs_diff_max']:.1e}, "
        f"full softmax {full['rollout_probs_diff_max']:.1e}"
    )
    assert full["rollout_probs_diff_max"] > 100 * GAP_BOUND
    # In bf16 (the generator's fp32 samples against the trainer's bf16 pass) within bf16's resolution.
    bf16 = Trainer(copy.deepcopy(model), TrainerConfig(top_p=0.9, compute_dtype="bfloat16")).train_step(groups)
    assert bf16["rollout_probs_diff_max"] < BF16_GAP_BOUND
    assert bf16["outside_nucleus_fraction"] < 0.1


BF16_GAP_BOUND = 0.25
"""|p_trainer - p_generator| with the trainer in bf16: 0.09 measured at the largest."""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tokens_outside_a_narrower_trainer_nucleus_train_without_nan(tiny: tuple[Any, Any, Any], dtype: str) -> None:
    """The trainer's nucleus narrower than the generator's (top-p 0.3 against 0.9): many sampled
    tokens fall outside it, as a few do where the two policies' numerics differ at the edge."""
    model, _, groups = tiny
    trainer = Trainer(copy.deepcopy(model), TrainerConfig(top_p=0.3, compute_dtype=dtype, learning_rate=1e-3))
    metrics = trainer.train_step(groups)
    assert 0.0 < metrics["outside_nucleus_fraction"] < 1.0
    for name in ("loss", "grad_norm", "entropy", "rollout_probs_diff_max", "is_weight_mean"):
        assert torch.isfinite(torch.tensor(metrics[name])), name
    assert metrics["grad_norm"] > 0
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
