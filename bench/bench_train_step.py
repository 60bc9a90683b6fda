"""GRPO step time and weight-sync time for the demo policy and a ~100M-parameter policy.

    python bench/bench_train_step.py [--models tiny,100m] [--device auto] [--steps 3]

Each step trains on synthetic finished groups (random completions, rewards with variance, so
every group contributes). "sync" is what the controller pays after a step to ship weights: the
trainer's CPU state-dict copy plus loading it into a transformers generation backend.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import torch

from spotrl_runtime.core.types import FinishedGroup, Prompt, Rollout
from spotrl_runtime.generation.transformers_backend import TransformersBackend
from spotrl_runtime.generation.weights import give_weights
from spotrl_runtime.models import load_policy
from spotrl_runtime.training import Trainer, TrainerConfig

MODELS = {"tiny": "builtin:tiny-arith", "100m": "builtin:random-100m"}


def synthetic_groups(
    vocab_size: int, groups: int, group_size: int, prompt_len: int, completion_len: int, seed: int = 0
) -> list[FinishedGroup]:
    """Finished groups of random tokens (ids 4..vocab-1) with a 0/1 reward pattern that always varies."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = (1, *(rng.randrange(4, vocab_size) for _ in range(prompt_len - 1)))
        rollouts = tuple(
            Rollout(
                group_id=f"g{g}",
                index=i,
                prompt_token_ids=prompt,
                completion_token_ids=tuple(rng.randrange(4, vocab_size) for _ in range(completion_len)),
                logprobs=tuple(-rng.uniform(0.5, 3.0) for _ in range(completion_len)),
                reward=float(i % 2),
                weight_version=0,
            )
            for i in range(group_size)
        )
        out.append(FinishedGroup(f"g{g}", Prompt(g, "synthetic", ""), 0, rollouts))
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_model(model_key: str, device: str, args: Any) -> dict[str, Any]:
    model_ref = MODELS.get(model_key, model_key)
    dtype = args.dtype
    policy, tokenizer = load_policy(model_ref, device, dtype=dtype)
    generator_model, _ = load_policy(model_ref, device, dtype=dtype)
    backend = TransformersBackend(generator_model, tokenizer)
    trainer = Trainer(
        policy,
        TrainerConfig(learning_rate=1e-5, micro_batch_size=args.micro_batch_size, kl_coef=args.kl_coef),
        pad_token_id=tokenizer.pad_token_id,
    )
    groups = synthetic_groups(
        policy.config.vocab_size, args.groups, args.group_size, args.prompt_len, args.completion_len
    )
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    trainer.train_step(groups)  # warm-up
    sync(device)
    step_times, tokens = [], 0.0
    for _ in range(args.steps):
        started = time.perf_counter()
        metrics = trainer.train_step(groups)
        sync(device)
        step_times.append(time.perf_counter() - started)
        tokens = metrics["tokens"]
    started = time.perf_counter()
    give_weights(backend, trainer.policy_state_dict(), trainer.step)
    sync(device)
    sync_seconds = time.perf_counter() - started
    step = sum(step_times) / len(step_times)
    return {
        "model": model_key,
        "device": device,
        "dtype": dtype,
        "params_m": sum(p.numel() for p in policy.parameters()) / 1e6,
        "rollouts": args.groups * args.group_size,
        "tokens": tokens,
        "micro_batch": args.micro_batch_size,
        "step_seconds": step,
        "train_tokens_per_s": tokens / step,
        "sync_seconds": sync_seconds,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'model':6} {'device':6} {'dtype':9} {'params':>8} {'rollouts':>8} {'tokens':>7}"
        f" {'step s':>8} {'tokens/s':>9} {'sync s':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['model']:6} {r['device']:6} {r['dtype']:9} {r['params_m']:7.1f}M {r['rollouts']:>8}"
            f" {r['tokens']:>7.0f} {r['step_seconds']:>8.3f} {r['train_tokens_per_s']:>9.0f} {r['sync_seconds']:>7.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,100m")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--completion-len", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--kl-coef", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    rows = [bench_model(m, device, args) for m in args.models.split(",")]
    print_table(rows)
    if args.json:
        for r in rows:
            print(json.dumps(r))


if __name__ == "__main__":
    main()
