"""Continuous batching: a generation worker fed a step's groups all at once (now) against the
way the pool fed it before (8 groups per call, each call waiting for its longest sample before
the next began), on the same worker code, model and requests, in one run.

    python bench/bench_continuous_batching.py [--models tiny,100m] [--backends transformers,vllm]
        [--groups 64] [--group-size 8] [--max-new-tokens 32] [--check]

The step is the GPU example's: 64 prompts × 8 samples. Per row: completion tokens per second,
and the groups the backend held unfinished per step (the most, and the mean over its steps).
vLLM's figure "now" against "before" is the issue's target (≥ 1.5×); vLLM against the
transformers backend is printed too. The random 100M model rarely samples its end token, so
its samples run to --max-new-tokens; the demo policy's stop after their answer.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import torch

from _targets import Targets, add_check
from bench_generation import MODELS, make_requests
from spotrl_runtime.generation import BackendSpec, GenerationRequest, GroupGenerated, build_backend
from spotrl_runtime.generation.worker import GenerationWorker

BEFORE_GROUPS_PER_CALL = 8
"""The pool's ``groups_per_call`` before continuous batching."""


@dataclass
class Row:
    model: str
    backend: str
    feed: str
    tokens: int
    seconds: float
    peak: int
    mean: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def run_feed(
    worker: GenerationWorker, requests: list[GenerationRequest], per_call: int, seq: int
) -> tuple[int, float, int]:
    """Feeds ``requests`` ``per_call`` at a time, each batch after the last one finished;
    returns (completion tokens, seconds, ordered calls used)."""
    tokens, started = 0, time.perf_counter()
    for first in range(0, len(requests), per_call):
        batch = requests[first : first + per_call]
        worker.submit(seq, batch)
        seq += 1
        left = {r.group_id for r in batch}
        while left:
            for outcome in worker.collect(timeout=5.0):
                assert isinstance(outcome, GroupGenerated), outcome
                left.discard(outcome.group_id)
                tokens += sum(len(s.completion_token_ids) for s in outcome.samples)
    return tokens, time.perf_counter() - started, seq


def bench(model_key: str, backend_kind: str, args: Any) -> list[Row]:
    model_ref = MODELS.get(model_key, model_key)
    spec = BackendSpec(kind=backend_kind, model=model_ref, dtype="float32", device="cpu", torch_threads=args.threads)  # type: ignore[arg-type]
    worker = GenerationWorker(spec, "bench", build_backend(spec))
    requests = make_requests(worker.backend.tokenizer, args.groups, args.group_size, args.max_new_tokens)  # type: ignore[attr-defined]
    seq = run_feed(worker, requests[:1], 1, 0)[2]  # warm-up
    rows = []
    for _ in range(args.repeats):  # interleaved, so that the machine's load hits both alike
        for feed, per_call in (("before", BEFORE_GROUPS_PER_CALL), ("now", len(requests))):
            worker.peak_generating, worker.steps, worker._generating_sum = 0, 0, 0
            tokens, seconds, seq = run_feed(worker, requests, per_call, seq)
            info = worker.info()
            rows.append(
                Row(model_key, backend_kind, feed, tokens, seconds, info["peak_generating"], info["mean_generating"])
            )
    worker.close()
    return rows


def merged(rows: list[Row]) -> list[Row]:
    """One row per (model, backend, feed): tokens and seconds summed over the repeats."""
    out: dict[tuple[str, str, str], Row] = {}
    for r in rows:
        key = (r.model, r.backend, r.feed)
        if key not in out:
            out[key] = Row(r.model, r.backend, r.feed, 0, 0.0, 0, 0.0)
        m = out[key]
        m.tokens, m.seconds = m.tokens + r.tokens, m.seconds + r.seconds
        m.peak, m.mean = max(m.peak, r.peak), max(m.mean, r.mean)
    return list(out.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,100m")
    parser.add_argument("--backends", default="transformers,vllm")
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="the worker's torch threads")
    add_check(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = merged([r for m in args.models.split(",") for b in args.backends.split(",") for r in bench(m, b, args)])
    print(
        f"{args.groups} groups × {args.group_size} samples, up to {args.max_new_tokens} new tokens,"
        f" {args.threads} threads"
    )
    header = (
        f"{'model':6} {'backend':12} {'feed':7} {'tokens':>8} {'seconds':>8} {'tokens/s':>9} {'peak':>5} {'mean':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r.model:6} {r.backend:12} {r.feed:7} {r.tokens:>8} {r.seconds:>8.2f} {r.tokens_per_s:>9.0f}"
            f" {r.peak:>5} {r.mean:>6.1f}"
        )
    by = {(r.model, r.backend, r.feed): r for r in rows}
    targets = Targets()
    for model in args.models.split(","):
        vllm_now, vllm_before = by.get((model, "vllm", "now")), by.get((model, "vllm", "before"))
        base = by.get((model, "transformers", "now"))
        if vllm_now and vllm_before:
            targets.at_least(
                f"{model}: vLLM tokens/s, all at once / {BEFORE_GROUPS_PER_CALL} groups a call",
                vllm_now.tokens_per_s / vllm_before.tokens_per_s,
                1.5,
            )
            print(f"{model}: vLLM now / before: {vllm_now.tokens_per_s / vllm_before.tokens_per_s:.2f}x", end="")
            if base:
                print(f"; vLLM / transformers now: {vllm_now.tokens_per_s / base.tokens_per_s:.2f}x", end="")
            print()
    targets.report(args.check)


if __name__ == "__main__":
    main()
