"""vLLM's CPU build, for real: the production backend on the machine the suite runs on.

One engine serves the module (its start is the expensive part). It runs in the test process,
as it runs in a generation worker's; ``close`` at the end leaves no process group behind. The
reference is the trainer's own forward pass (transformers) on the same weights: a trained
token's log-prob under the generator and under the trainer must agree to float32 rounding,
and every check here is paired with the fault it exists to catch (a sync skipped, one tensor
loaded wrongly, the tied head left behind, the prefix cache kept) and asserts that fault shows.
"""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from spotrl_runtime import failpoints
from spotrl_runtime.generation import BackendSpec, GenerationRequest, GroupLost, GroupOutcome, sampling_logprobs
from spotrl_runtime.generation.types import FINISH_LENGTH, FINISH_STOP, GroupFailed, GroupGenerated
from spotrl_runtime.generation.vllm_backend import VLLMBackend
from spotrl_runtime.generation.weights import give_weights
from spotrl_runtime.generation.worker import GenerationWorker
from spotrl_runtime.models import load_policy, resolve_model_dir
from spotrl_runtime.training import logprobs as lp
from spotrl_runtime.vllm_build import vllm_build

pytestmark = pytest.mark.skipif(
    vllm_build() == "cuda" or platform.machine() != "x86_64",
    # Not skipped where the CPU build is missing but belongs: there the backend's install message fails the test.
    reason="vLLM's CPU build is for x86-64 machines without its CUDA build (test_generation_gpu.py covers that)",
)

GAP_BOUND = 1e-4
"""float32 on the CPU: the worst per-token |log-prob difference| measured was ~2e-6."""
FAULT_FLOOR = 0.05
"""A fault (weights that did not arrive) moves the worst token by far more: 1.6-12 measured."""
PROMPTS = ["3+4=", "9-2=", "7+8=", "5+5="]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMBackend]:
    # An empty vLLM cache: the engine inspects the model's class, in this process on the CPU;
    # vLLM's inspection subprocess, were it started, would fail.
    from vllm.model_executor.models import registry

    cache = tmp_path_factory.mktemp("vllm-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CACHE_ROOT", str(cache))
        mp.setattr(registry, "_SUBPROCESS_COMMAND", [sys.executable, "-c", "raise SystemExit(3)"])
        # block_size 16: the tiny policy's 64-token context never fills one of vLLM's default
        # 128-token blocks, and prefix caching reuses whole blocks only.
        backend = VLLMBackend(
            str(resolve_model_dir("builtin:tiny-arith")), dtype="float32", device="cpu", threads=1, block_size=16
        )
    assert [p.name for p in (cache / "modelinfos").iterdir()] == [
        "vllm-model_executor-models-llama-LlamaForCausalLM.json"
    ]
    try:
        yield backend
    finally:
        backend.close()
    assert not torch.distributed.is_initialized(), "close() left vLLM's process group behind"


@pytest.fixture
def reference(engine: VLLMBackend) -> Iterator[tuple[Any, Any]]:
    """The trainer's model with the engine's weights, which each test puts back as it found them."""
    model, tok = load_policy("builtin:tiny-arith", "cpu")
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    yield model, tok
    give_weights(engine, initial, version=0)


def _requests(tok: Any, n: int = 8, max_new_tokens: int = 8, seed: int = 0) -> list[GenerationRequest]:
    return [
        GenerationRequest(f"g{i}", tuple(tok(p)["input_ids"]), n, max_new_tokens, seed=seed + i)
        for i, p in enumerate(PROMPTS)
    ]


def _worst_gap(model: Any, results: Sequence[GroupGenerated]) -> float:
    """The largest |generator log-prob - trainer log-prob| over every sampled token."""
    worst = 0.0
    for r in results:
        for s in r.samples:
            ids = torch.tensor([r.prompt_token_ids + s.completion_token_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(r.prompt_token_ids) - 1 : -1].float()
            n = logits.shape[0]
            dist = sampling_logprobs(logits, torch.ones(n), torch.ones(n))
            expected = dist[torch.arange(n), ids[0, len(r.prompt_token_ids) :]]
            worst = max(worst, float((torch.tensor(s.logprobs) - expected).abs().max()))
    return worst


def _moved(state: Mapping[str, torch.Tensor], seed: int, only: str | None = None) -> dict[str, torch.Tensor]:
    """``state`` with noise on every weight (or on ``only``), norms kept; a tied head stays tied."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state.items():
        noisy = ("norm" not in k) and (only is None or k == only)
        out[k] = v + 0.3 * torch.randn(v.shape, generator=generator) if noisy else v.clone()
    if "lm_head.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def test_seeded_groups_are_reproducible_and_seeds_matter(engine: VLLMBackend, reference: tuple[Any, Any]) -> None:
    _, tok = reference
    first, again = engine.generate(_requests(tok)), engine.generate(_requests(tok))
    assert [r.samples for r in first] == [r.samples for r in again]
    other = engine.generate(_requests(tok, seed=100))
    assert [r.samples for r in other] != [r.samples for r in first]
    # A group's samples do not depend on the other groups of the call: the same tokens; the
    # log-probs to float rounding, since a batch of another shape sums in another order (seen
    # 5e-7 apart on an AVX2 CPU).
    alone = engine.generate(_requests(tok)[2:3])
    assert _tokens(alone[0]) == _tokens(first[2])
    assert _logprobs(alone[0]) == pytest.approx(_logprobs(first[2]), abs=1e-5)


def _tokens(result: GroupGenerated) -> list[tuple[tuple[int, ...], str, str]]:
    return [(s.completion_token_ids, s.text, s.finish_reason) for s in result.samples]


def _logprobs(result: GroupGenerated) -> list[float]:
    return [x for s in result.samples for x in s.logprobs]


def test_n_samples_per_group_in_order(engine: VLLMBackend, reference: tuple[Any, Any]) -> None:
    _, tok = reference
    sizes = (8, 5, 2)
    requests = [
        GenerationRequest(f"q{n}", tuple(tok(p)["input_ids"]), n, 6, seed=n)
        for n, p in zip(sizes, PROMPTS[: len(sizes)], strict=True)
    ]
    results = engine.generate(requests)
    assert [r.group_id for r in results] == ["q8", "q5", "q2"]
    assert [len(r.samples) for r in results] == [8, 5, 2]
    assert all(r.weight_version == engine.weight_version for r in results)
    for s in (s for r in results for s in r.samples):
        assert len(s.logprobs) == len(s.completion_token_ids) >= 1
        assert all(lp <= 0.0 for lp in s.logprobs)


def test_stop_and_length_finish_reasons(engine: VLLMBackend, reference: tuple[Any, Any]) -> None:
    _, tok = reference
    eos = tok.eos_token_id
    reasons = set()
    for max_new in (1, 8):
        for s in (s for r in engine.generate(_requests(tok, max_new_tokens=max_new)) for s in r.samples):
            reasons.add(s.finish_reason)
            if s.finish_reason == FINISH_STOP:
                assert s.completion_token_ids[-1] == eos
                assert eos not in s.completion_token_ids[:-1]
            else:
                assert s.finish_reason == FINISH_LENGTH
                assert len(s.completion_token_ids) == max_new
                assert eos not in s.completion_token_ids
    assert reasons == {FINISH_STOP, FINISH_LENGTH}


def test_logprobs_match_the_trainers_forward_pass(engine: VLLMBackend, reference: tuple[Any, Any]) -> None:
    model, tok = reference
    gap = _worst_gap(model, engine.generate(_requests(tok)))
    print(f"vLLM CPU float32: worst per-token log-prob gap against the trainer {gap:.2e}")
    assert gap < GAP_BOUND


def test_at_top_p_the_trainers_logprobs_are_vllms(engine: VLLMBackend, reference: tuple[Any, Any]) -> None:
    """vLLM returns log-probs renormalised over the top-p nucleus; the trainer takes its own the
    same way (the nucleus of its own logits), so they agree to float32 rounding. The full softmax
    (the trainer before it took top-p) is off by the nucleus' log-mass, up to -log(0.9)."""
    model, tok = reference
    requests = [
        GenerationRequest(f"p{i}", tuple(tok(p)["input_ids"]), 8, 8, temperature=1.0, top_p=0.9, seed=i)
        for i, p in enumerate(PROMPTS)
    ]
    results = engine.generate(requests)
    generated = torch.tensor([x for r in results for s in r.samples for x in s.logprobs])
    batch = lp.token_batch([(r.prompt_token_ids, s.completion_token_ids) for r in results for s in r.samples], 0, "cpu")
    with torch.no_grad():
        trainer, _ = lp.call(model, batch, 1.0, 0.9)
        full, _ = lp.call(model, batch, 1.0, 1.0)
    gap = float((generated - trainer).abs().max())
    print(f"vLLM CPU top-p 0.9: worst log-prob gap {gap:.2e}, full softmax {float((generated - full).abs().max()):.2e}")
    assert torch.isfinite(trainer).all(), "a sampled token outside the trainer's nucleus"
    assert gap < GAP_BOUND
    assert float((generated - full).abs().max()) > 100 * GAP_BOUND


def test_reloaded_weights_arrive_and_a_skipped_or_wrong_sync_shows(
    engine: VLLMBackend, reference: tuple[Any, Any]
) -> None:
    model, tok = reference
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    moved = _moved(initial, seed=1)
    give_weights(engine, moved, version=3)
    after = engine.generate(_requests(tok))
    assert {r.weight_version for r in after} == {3}
    # A skipped sync: the trainer's weights moved, the engine's did not (the engine still serves
    # what it had); against the trainer's new weights the gap is large.
    model.load_state_dict(moved)
    assert _worst_gap(model, after) < GAP_BOUND
    model.load_state_dict(initial)
    assert _worst_gap(model, after) > FAULT_FLOOR
    # One tensor loaded wrongly.
    model.load_state_dict(moved)
    wrong = dict(moved)
    wrong["model.layers.1.mlp.down_proj.weight"] = moved["model.layers.1.mlp.down_proj.weight"] * 1.5
    give_weights(engine, wrong, version=4)
    assert _worst_gap(model, engine.generate(_requests(tok))) > FAULT_FLOOR


def test_weights_in_many_small_buckets_arrive_whole(engine: VLLMBackend, reference: tuple[Any, Any]) -> None:
    """Buckets of 4 KiB split every layer's tensors across buckets (q, k and v of one attention
    layer apart): vLLM's layerwise reload keeps a layer's tensors until the layer is whole, so
    they must outlive the receive buffer, which the next bucket overwrites."""
    model, tok = reference
    moved = _moved(model.state_dict(), seed=5)
    give_weights(engine, moved, version=8, bucket_bytes=4096)
    model.load_state_dict(moved)
    assert _worst_gap(model, engine.generate(_requests(tok))) < GAP_BOUND


def test_a_new_embedding_reaches_the_tied_lm_head(engine: VLLMBackend, reference: tuple[Any, Any]) -> None:
    """vLLM 0.24's reload left the tied head with its old weights (12 nats of gap on this model)."""
    model, tok = reference
    assert model.config.tie_word_embeddings
    moved = _moved(model.state_dict(), seed=2, only="model.embed_tokens.weight")
    give_weights(engine, moved, version=5)
    model.load_state_dict(moved)
    assert _worst_gap(model, engine.generate(_requests(tok))) < GAP_BOUND


def test_the_prefix_cache_is_reset_by_a_reload(
    engine: VLLMBackend, reference: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt longer than a cache block, generated before and after a reload: the second
    generation must not reuse the block computed with the old weights."""
    model, tok = reference
    long_prompt = tuple(tok("1+2=3 4+4=8 9-3=6 5+2=7 8-8=0 7+1=")["input_ids"])
    assert len(long_prompt) > 32  # two full 16-token blocks to reuse

    def run() -> list[GroupGenerated]:
        return engine.generate([GenerationRequest("long", long_prompt, 4, 4, seed=7)])

    moved = _moved(model.state_dict(), seed=3)
    run()
    give_weights(engine, moved, version=6)
    model.load_state_dict(moved)
    assert _worst_gap(model, run()) < GAP_BOUND
    # The fault this guards against: the same reload without the reset serves the stale blocks.
    monkeypatch.setattr(engine.llm, "reset_prefix_cache", lambda *a, **k: True)
    again = _moved(moved, seed=4)
    run()
    give_weights(engine, again, version=7)
    model.load_state_dict(again)
    assert _worst_gap(model, run()) > FAULT_FLOOR


def _streamed(tok: Any, count: int) -> list[GenerationRequest]:
    """``count`` groups of 4, every third one short: short groups finish while long ones run."""
    return [
        GenerationRequest(
            f"s{i}", tuple(tok(PROMPTS[i % len(PROMPTS)])["input_ids"]), 4, 2 if i % 3 == 0 else 24, seed=50 + i
        )
        for i in range(count)
    ]


def _collect(worker: GenerationWorker, count: int, timeout: float = 300.0) -> list[GroupOutcome]:
    outcomes: list[GroupOutcome] = []
    deadline = time.monotonic() + timeout
    while len(outcomes) < count:
        assert time.monotonic() < deadline, f"{len(outcomes)} of {count} outcomes after {timeout} s"
        outcomes.extend(worker.collect(timeout=1.0))
    return outcomes


def test_every_submitted_group_generates_at_once_and_streams_back(
    engine: VLLMBackend, reference: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, tok = reference
    requests = _streamed(tok, 24)
    expected = {r.group_id: r.samples for r in engine.generate(requests)}
    length = {g: max(len(s.completion_token_ids) for s in samples) for g, samples in expected.items()}
    # The worker's thread holds after the engine's third step: the groups done in two tokens
    # (the short ones) are finished, those that run four or more (s1 and s2 at least) are not.
    assert max(length.values()) >= 4, length
    monkeypatch.setenv("SPOTRL_FAILPOINTS", "worker.stepped@3=60")
    monkeypatch.setenv("SPOTRL_FAILPOINT_DIR", str(tmp_path))
    monkeypatch.setattr(failpoints, "_spec", None)
    worker = GenerationWorker(BackendSpec(kind="vllm", model="builtin:tiny-arith"), "w0", backend=engine)
    try:
        assert worker.submit(0, requests[:12]) == 12
        assert worker.submit(1, requests[12:]) == 12
        deadline = time.monotonic() + 120
        while not (tmp_path / "worker.stepped").exists():
            assert time.monotonic() < deadline, "the worker never stepped"
            time.sleep(0.05)
        # Streamed: what finished is back while the rest is still in the engine (a worker that
        # answers a batch at a time, in the order submitted, has nothing to give yet).
        early = worker.collect(timeout=2.0)
        unfinished = engine.unfinished()
        (tmp_path / "worker.stepped.release").touch()
        outcomes = early + _collect(worker, 24 - len(early))
    finally:
        (tmp_path / "worker.stepped.release").touch()
        worker.stop()
    assert early, "nothing came back before every group had finished"
    assert unfinished > 0
    assert max(length[o.group_id] for o in early) <= 2, [(o.group_id, length[o.group_id]) for o in early]
    # All 24 were in the engine together (two submits, one batch), not 8 at a time.
    assert worker.peak_generating == 24
    assert all(isinstance(o, GroupGenerated) and o.worker == "w0" for o in outcomes)
    assert {o.group_id: o.samples for o in outcomes if isinstance(o, GroupGenerated)} == expected


def test_an_abort_leaves_no_group_behind_and_redispatched_groups_generate_as_before(
    engine: VLLMBackend, reference: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, tok = reference
    requests = [replace(r, max_new_tokens=40) for r in _streamed(tok, 16)]
    expected = {r.group_id: r.samples for r in engine.generate(requests)}
    # The worker's thread holds after the engine's first step: every group is in the engine, and
    # none whose samples need more than one token has finished.
    monkeypatch.setenv("SPOTRL_FAILPOINTS", "worker.stepped@1=60")
    monkeypatch.setenv("SPOTRL_FAILPOINT_DIR", str(tmp_path))
    monkeypatch.setattr(failpoints, "_spec", None)
    worker = GenerationWorker(BackendSpec(kind="vllm", model="builtin:tiny-arith"), "w0", backend=engine)
    try:
        worker.submit(0, requests)
        deadline = time.monotonic() + 120
        while not (tmp_path / "worker.stepped").exists():
            assert time.monotonic() < deadline, "the worker never stepped"
            time.sleep(0.05)
        aborted = worker.abort()
        (tmp_path / "worker.stepped.release").touch()
        outcomes = _collect(worker, len(requests))
    finally:
        worker.stop()
    assert engine.unfinished() == 0
    by_id = {o.group_id: o for o in outcomes}
    assert sorted(by_id) == sorted(r.group_id for r in requests), "every group came back exactly once"
    assert len(outcomes) == len(requests)
    lost = sorted(g for g, o in by_id.items() if isinstance(o, GroupLost))
    assert lost, "nothing was unfinished at the abort"
    assert lost == sorted(aborted), "the abort stopped the unfinished groups, and only those"
    # Redispatched under the same ids, they generate what they would have without the abort.
    again = [r for r in requests if r.group_id in lost]
    assert {r.group_id: r.samples for r in engine.generate(again)} == {g: expected[g] for g in lost}


def test_a_request_the_engine_refuses_fails_alone(engine: VLLMBackend, reference: tuple[Any, Any]) -> None:
    """vLLM refuses a prompt longer than its context (tiny-arith's 64 positions) in
    ``add_request``: through a worker, that group alone comes back failed, with vLLM's reason;
    the groups beside it generate what they generate without it."""
    _, tok = reference
    requests = _requests(tok)
    expected = {r.group_id: r.samples for r in engine.generate(requests)}
    long = GenerationRequest("too-long", tuple(tok("1+2=" * 20)["input_ids"]), 8, 8, seed=7)
    assert len(long.prompt_token_ids) > 64
    worker = GenerationWorker(BackendSpec(kind="vllm", model="builtin:tiny-arith"), "w0", backend=engine)
    try:
        outcomes = worker.generate([*requests[:2], long, *requests[2:]])
    finally:
        worker.stop()
    assert engine.unfinished() == 0
    failed = [o for o in outcomes if isinstance(o, GroupFailed)]
    assert [o.group_id for o in failed] == ["too-long"], outcomes
    assert "vLLM refused the request" in failed[0].error
    assert "maximum context length is 64 tokens" in failed[0].error
    assert {o.group_id: o.samples for o in outcomes if isinstance(o, GroupGenerated)} == expected
