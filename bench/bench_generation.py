"""Generation per backend: the engine's start (seconds until it can generate) and completion
tokens per second, on the same model, device and batch, in one run.

    python bench/bench_generation.py [--models tiny,100m] [--backends transformers,vllm] [--device auto]

Rows: the demo policy (builtin:tiny-arith) and a ~100M-parameter random-weight Llama
(builtin:random-100m), on the transformers backend and on vLLM, both on --device: the CPU here
(vLLM's CPU build) or CUDA (its CUDA build); a row whose vLLM build cannot serve the device says
so. "start" is building the backend in this process, where torch and transformers are already
imported (the first vLLM row includes importing vLLM); vLLM's start and tokens/s are reported
against the transformers backend's. The
random model rarely samples its end token, so its samples run to --max-new-tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Any

import torch

from spotrl_runtime.generation import BackendSpec, GenerationBackend, GenerationRequest, build_backend
from spotrl_runtime.models import resolve_model_dir

MODELS = {"tiny": "builtin:tiny-arith", "100m": "builtin:random-100m"}
PROMPTS = ["3+4=", "9-2=", "7+8=", "5+5=", "6-1=", "2+9=", "8-3=", "4+4="]


@dataclass
class Row:
    model: str
    backend: str
    device: str
    params_m: float
    groups: int
    group_size: int
    new_tokens: int
    seconds: float
    note: str = ""
    start_seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


def make_requests(tokenizer: Any, groups: int, group_size: int, max_new_tokens: int) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            group_id=f"g{i}",
            prompt_token_ids=tuple(tokenizer(PROMPTS[i % len(PROMPTS)])["input_ids"]),
            n=group_size,
            max_new_tokens=max_new_tokens,
            temperature=1.0,
            seed=i,
        )
        for i in range(groups)
    ]


def time_generation(backend: GenerationBackend, requests: list[GenerationRequest], repeats: int) -> tuple[int, float]:
    """(completion tokens, seconds) over ``repeats`` calls after one warm-up call."""
    backend.generate(requests[:1])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    tokens, started = 0, time.perf_counter()
    for _ in range(repeats):
        for result in backend.generate(requests):
            tokens += sum(len(s.completion_token_ids) for s in result.samples)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return tokens, time.perf_counter() - started


def param_count(model_ref: str) -> float:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(resolve_model_dir(model_ref))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters()) / 1e6


def bench(
    model_key: str,
    backend_kind: str,
    device: str,
    groups: int,
    group_size: int,
    max_new_tokens: int,
    repeats: int,
    threads: int = 0,
) -> Row:
    model_ref = MODELS.get(model_key, model_key)
    params = param_count(model_ref)
    row = Row(model_key, backend_kind, device, params, groups, group_size, 0, 0.0)
    if backend_kind == "vllm":
        from spotrl_runtime.vllm_build import vllm_build, vllm_build_problem

        problem = vllm_build_problem(device, vllm_build())
        if problem is not None:
            row.note = f"skipped: {problem}"
            return row
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    spec = BackendSpec(kind=backend_kind, model=model_ref, dtype=dtype, device=device, torch_threads=threads)  # type: ignore[arg-type]
    started = time.perf_counter()
    backend = build_backend(spec)
    row.start_seconds = time.perf_counter() - started
    tokenizer = backend.tokenizer  # type: ignore[attr-defined]
    row.new_tokens, row.seconds = time_generation(
        backend, make_requests(tokenizer, groups, group_size, max_new_tokens), repeats
    )
    backend.close()
    return row


def print_table(rows: list[Row]) -> None:
    header = (
        f"{'model':6} {'backend':12} {'device':6} {'params':>8} {'start s':>8} {'groups×G':>9}"
        f" {'tokens':>8} {'seconds':>8} {'tokens/s':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        if r.note:
            print(f"{r.model:6} {r.backend:12} {r.device:6} {r.params_m:7.1f}M  {r.note}")
            continue
        print(
            f"{r.model:6} {r.backend:12} {r.device:6} {r.params_m:7.1f}M {r.start_seconds:>8.1f}"
            f" {r.groups:>4}×{r.group_size:<4} {r.new_tokens:>8} {r.seconds:>8.2f} {r.tokens_per_s:>10.0f}"
        )
    done = {(r.model, r.backend): r for r in rows if not r.note}
    for model in dict.fromkeys(r.model for r in rows):
        base, vllm = done.get((model, "transformers")), done.get((model, "vllm"))
        if base is not None and vllm is not None and base.start_seconds and base.tokens_per_s:
            print(
                f"{model}: vLLM against transformers: start {vllm.start_seconds / base.start_seconds:.1f}x, "
                f"tokens/s {vllm.tokens_per_s / base.tokens_per_s:.2f}x"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,100m", help="comma list of tiny, 100m or model refs")
    parser.add_argument("--backends", default="transformers,vllm")
    parser.add_argument("--device", default="auto", help="both backends' device: auto, cpu, cuda")
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--json", action="store_true", help="also print the rows as JSON lines")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    rows = [
        bench(m, b, device, args.groups, args.group_size, args.max_new_tokens, args.repeats, args.threads)
        for m in args.models.split(",")
        for b in args.backends.split(",")
    ]
    print_table(rows)
    if args.json:
        for r in rows:
            print(json.dumps({**r.__dict__, "tokens_per_s": r.tokens_per_s}))


if __name__ == "__main__":
    main()
