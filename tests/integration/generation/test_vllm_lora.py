"""vLLM's CPU build serving a LoRA job (policy.lora): the base once, each adapter version the
trainer sends hot-loaded under its own name. The engine's log-probs agree with the trainer's
own pass (base + adapter) on average over the sampled tokens; a skipped adapter update, or one
tensor of it loaded wrongly, shows far above that; groups started on one version finish on it
after the next arrives; old versions are let go. In float32 and in the users' bf16 (one engine each)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_vllm_cpu import PROMPTS, pytestmark  # noqa: F401  (the same skip)
from vllm_cpu import cpu_engine

from spotrl_runtime.api.rljob import Lora
from spotrl_runtime.generation import GenerationRequest
from spotrl_runtime.generation.vllm_backend import VLLMBackend
from spotrl_runtime.generation.weights import give_weights
from spotrl_runtime.models import lora
from spotrl_runtime.training import Trainer, TrainerConfig, precision
from spotrl_runtime.training import logprobs as lp

SPEC = Lora(rank=8)
KEEP = 3
# dtype -> (the mean gap bound, the floor a fault clears). The mean, not the worst token: in bf16
# the worst of a few hundred tokens is one token near a rounding edge and moves with the CPU's
# kernels (0.13 to 0.66 for one adapter on AVX2), the mean stays near 0.015 and a fault is near 1.
BOUNDS = {"float32": (1e-4, 0.5), "bfloat16": (0.05, 0.5)}


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMBackend]:
    backend = cpu_engine(tmp_path_factory, "builtin:tiny-arith", request.param, lora=SPEC, max_loras=KEEP)
    try:
        yield backend
    finally:
        backend.close()


def lora_trainer(dtype: str) -> tuple[Trainer, Any]:
    from spotrl_runtime.api.rljob import Policy

    policy = Policy(model="builtin:tiny-arith", dtype=dtype, lora=SPEC)  # type: ignore[arg-type]
    model, tok, identity = lora.load_trainable(policy, "cpu", seed=0)
    return Trainer(model, TrainerConfig(compute_dtype=dtype), adapter=identity), tok


def move(trainer: Trainer, seed: int) -> None:
    """A training step's worth of change: noise on every adapter matrix (B starts at zero)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.trained_state(keep_vars=True).values():
            p.add_(0.3 * torch.randn(p.shape, generator=generator))


def requests(tok: Any, tag: str = "g") -> list[GenerationRequest]:
    return [GenerationRequest(f"{tag}{i}", tuple(tok(p)["input_ids"]), 8, 8, seed=i) for i, p in enumerate(PROMPTS)]


def mean_gap(trainer: Trainer, results: list[Any], *, base: bool = False) -> float:
    """The mean |generator log-prob - trainer log-prob| over every sampled token (what the job
    reports as rollout_probs_diff_mean), the trainer's as it trains (autocast to the compute
    dtype); ``base``: its adapter off."""
    pairs = [(r.prompt_token_ids, s.completion_token_ids) for r in results for s in r.samples]
    generated = torch.tensor([x for r in results for s in r.samples for x in s.logprobs])
    batch = lp.token_batch(pairs, 0, "cpu")
    off = lora.base_only(trainer.model) if base else precision.autocast("cpu", torch.float32)
    with torch.no_grad(), precision.autocast("cpu", trainer.compute_dtype), off:
        own, _ = lp.call(trainer.model, batch, 1.0)
    return float((generated - own).abs().mean())


def test_adapter_versions_reach_the_engine_and_a_skipped_or_wrong_one_shows(engine: VLLMBackend) -> None:
    dtype = str(engine.llm.llm_engine.model_config.dtype).removeprefix("torch.")
    bound, floor = BOUNDS[dtype]
    trainer, tok = lora_trainer(dtype)
    start = engine.generate(requests(tok))
    assert mean_gap(trainer, start) < bound, "version 0 is the base: B starts at zero"

    move(trainer, seed=1)
    sent = trainer.policy_state_dict()
    assert set(sent) == set(trainer.trained_state()), "the adapter alone travels"
    assert {v.dtype for v in sent.values()} == {trainer.compute_dtype}
    give_weights(engine, sent, version=1)
    after = engine.generate(requests(tok))
    assert {r.weight_version for r in after} == {1}
    gap = mean_gap(trainer, after)
    print(f"vLLM CPU {dtype} with a rank-8 adapter: mean per-token log-prob gap against the trainer {gap:.2e}")
    assert gap < bound
    assert mean_gap(trainer, after, base=True) > floor, "an adapter that did not arrive shows"

    wrong = dict(sent)
    name = next(n for n in sent if "layers.1.mlp.down_proj.lora_B" in n)
    wrong[name] = sent[name] * -3
    give_weights(engine, wrong, version=2)
    assert mean_gap(trainer, engine.generate(requests(tok))) > floor, "one tensor loaded wrongly shows"


def test_groups_started_on_a_version_finish_on_it_and_old_versions_go(engine: VLLMBackend) -> None:
    dtype = str(engine.llm.llm_engine.model_config.dtype).removeprefix("torch.")
    bound, _ = BOUNDS[dtype]
    trainer, tok = lora_trainer(dtype)
    move(trainer, seed=3)
    give_weights(engine, trainer.policy_state_dict(), version=10)
    old = {k: v.clone() for k, v in trainer.trained_state().items()}
    engine.start(requests(tok, "early"))
    move(trainer, seed=4)
    give_weights(engine, trainer.policy_state_dict(), version=11)  # while the early groups generate
    engine.start(requests(tok, "late"))
    done: dict[str, Any] = {}
    while engine.unfinished():
        done.update((r.group_id, r) for r in engine.step())
    early = [r for g, r in done.items() if g.startswith("early")]
    late = [r for g, r in done.items() if g.startswith("late")]
    assert {r.weight_version for r in early} == {10}
    assert {r.weight_version for r in late} == {11}
    assert mean_gap(trainer, late) < bound
    trainer.load_trained_state(old)
    assert mean_gap(trainer, early) < bound, "the early groups finished on their own adapter"

    for version in range(12, 12 + KEEP + 1):
        give_weights(engine, trainer.policy_state_dict(), version=version)
    assert engine.llm.llm_engine.list_loras() == {v + 1 for v in range(12 + 1, 12 + KEEP + 1)}
