"""The trainer at the users' numerics and memory (issue 43), before against after, in one run.

    python bench/bench_numerics.py [--only movement,step,fsdp] [--rows 8] [--completion 384]

**movement**: the chat example's policy (builtin:tiny-chat, Qwen2-shaped) trained 6 steps at lr
1e-6, as the GPU examples' bf16 jobs are: how far the weights move (the L2 norm of the change,
what two cuts of the run would differ by) and the share of entries that changed, for float32,
bfloat16 with float32 masters (now), and bfloat16 weights stepped by AdamW directly (before).

**step**: one GRPO step of ``builtin:random-0.5b`` (Qwen2.5-0.5B's shape, 151,936-entry
vocabulary) on ``--rows`` rollouts of 128 prompt tokens and up to ``--completion`` completion
tokens, each variant in a fresh process: peak resident memory, step seconds, padding share,
trained tokens per second. "before" is the step as the trainer took it until this issue: the
model's whole ``[rows, seq, vocab]`` logits, an fp32 log-softmax over every position, rows in
fixed micro-batches, no activation checkpointing, the dtype's own weights stepped by AdamW.

**fsdp**: the same step on 2 FSDP ranks (gloo): each rank's peak resident memory.

The variants ``packed fp32`` and ``packed bf16`` are the step with ``training.packing`` (several
rollouts a row of a micro-batch), against ``after fp32``/``after bf16``'s padded rows.

On a GPU (``--device cuda``, as ``e2e/gpu/check.sh`` runs it) the step reports peak GPU memory
(``torch.cuda.max_memory_allocated``) instead, the median of 3 steps after one of warm-up, and
``--policies 0.5b,1.5b`` adds a policy in Qwen2.5-1.5B's shape.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import resource
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from _targets import Targets, add_check  # noqa: E402
from bench_train_step import synthetic_groups  # noqa: E402
from spotrl_runtime.core.types import FinishedGroup  # noqa: E402
from spotrl_runtime.models import load_policy  # noqa: E402
from spotrl_runtime.training import Trainer, TrainerConfig  # noqa: E402
from spotrl_runtime.training.rows import micro_batch_rows, step_rows  # noqa: E402

STEP_POLICY = "builtin:random-0.5b"


def policy_ref(name: str) -> str:
    """``0.5b``: builtin:random-0.5b; ``1.5b``: a random policy in Qwen2.5-1.5B's shape (built once)."""
    if name == "1.5b":
        from spotrl_runtime.models.random_policy import RANDOM_1_5B, random_policy_dir

        return str(random_policy_dir(RANDOM_1_5B))
    return STEP_POLICY


# ----------------------------------------------------------------------------- movement


def movement(steps: int = 6, lr: float = 1e-6) -> list[dict[str, Any]]:
    start, _tokenizer = load_policy("builtin:tiny-chat")
    groups = synthetic_groups(start.config.vocab_size, 8, 4, 24, 24, seed=1)
    rows = []
    for name, dtype, masters in (
        ("float32", "float32", True),
        ("bfloat16 (now)", "bfloat16", True),
        ("bfloat16 (before)", "bfloat16", False),
    ):
        trainer = Trainer(copy.deepcopy(start), TrainerConfig(learning_rate=lr, compute_dtype=dtype, seed=1))
        if not masters:
            trainer.model.to(torch.bfloat16)  # the optimizer holds the same, now bf16, parameters
        before = {n: p.detach().float().clone() for n, p in trainer.model.named_parameters()}
        for _ in range(steps):
            trainer.train_step(groups)
        delta = torch.cat([(p.detach().float() - before[n]).reshape(-1) for n, p in trainer.model.named_parameters()])
        rows.append({"run": name, "moved": float(delta.norm()), "changed": float((delta != 0).float().mean())})
    for r in rows:
        r["vs_fp32"] = r["moved"] / rows[0]["moved"]
    return rows


# ----------------------------------------------------------------------------- one step


def step_groups(vocab: int, rows: int, completion: int) -> list[FinishedGroup]:
    """``rows`` rollouts in groups of 4: 128-token prompts, completions of 1/8 to all of
    ``completion`` tokens (a step's lengths vary; the padding they cost is what batching saves)."""
    rng = random.Random(7)
    groups = []
    for g in range(max(1, rows // 4)):
        (group,) = synthetic_groups(vocab, 1, min(4, rows), 128, completion, seed=g)
        cut = [rng.randint(completion // 8, completion) for _ in group.rollouts]
        rollouts = tuple(
            replace(r, completion_token_ids=r.completion_token_ids[:n], logprobs=r.logprobs[:n])
            for r, n in zip(group.rollouts, cut, strict=True)
        )
        groups.append(replace(group, group_id=f"g{g}", rollouts=rollouts))
    return groups


def baseline_step(model: Any, groups: list[FinishedGroup], micro: int, dtype: torch.dtype) -> dict[str, float]:
    """The step as the trainer took it before: whole-vocabulary logits and log-softmax at every
    position of right-padded rows in fixed micro-batches, AdamW on the model's own weights."""
    model.to(dtype)
    optimizer = getattr(model, "_bench_optimizer", None) or torch.optim.AdamW(model.parameters(), lr=1e-6)
    model._bench_optimizer = optimizer
    plan = step_rows(groups)
    rows, padded = plan.rows, 0
    model.train()
    for start in range(0, len(rows), micro):
        chunk = rows[start : start + micro]
        width = max(len(r.prompt_ids) + len(r.completion_ids) for r in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros((len(chunk), width - 1), dtype=torch.bool)
        adv = torch.tensor([r.advantage for r in chunk]).unsqueeze(-1)
        for i, r in enumerate(chunk):
            seq = r.prompt_ids + r.completion_ids
            ids[i, : len(seq)] = torch.tensor(seq)
            mask[i, len(r.prompt_ids) - 1 : len(seq) - 1] = True
        padded += ids.numel()
        device = next(model.parameters()).device
        ids, mask, adv = ids.to(device), mask.to(device), adv.to(device)
        logits = model(input_ids=ids, attention_mask=(ids != 0).long()).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():  # the entropy metric, as it was: over the whole logits, in chunks
            picked = logits[mask].float()
            for s in range(0, picked.shape[0], 1024):
                lp = torch.log_softmax(picked[s : s + 1024], -1)
                (lp.exp() * lp).sum()
        loss = -(torch.exp(logp - logp.detach()) * adv * mask).sum() / plan.tokens
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    real = sum(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
    return {"tokens": float(plan.tokens), "padding_share": 1 - real / padded}


def attention_pairs(rows: list[Any], config: TrainerConfig) -> tuple[int, int]:
    """(query-key pairs a step's attention computes densely, as SDPA does over each micro-batch
    row; pairs within each rollout alone, what flash-attention's varlen kernel computes), per layer
    and head, under ``config``'s micro-batches and packing."""
    dense = varlen = 0
    for chunk in config.plan(rows):
        lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in chunk]
        layout = micro_batch_rows(lengths, config.packed)
        width = max(sum(lengths[i] for i in row) for row in layout)
        dense += len(layout) * width * width
        varlen += sum(n * n for n in lengths)
    return dense, varlen


def one_step(variant: str, rows: int, completion: int, device: str = "cpu", policy: str = "0.5b") -> dict[str, Any]:
    """Runs in a fresh process: ``variant``'s step (on a GPU: one warm-up step, then the median
    of 3); the process's peak resident memory, or on a GPU its peak allocated memory."""
    dtype = "bfloat16" if variant.endswith("bf16") else "float32"
    packing = variant.startswith("packed")
    model, _ = load_policy(policy_ref(policy), device, dtype="float32")
    groups = step_groups(model.config.vocab_size, rows, completion)
    cuda = device.startswith("cuda")
    trainer = None
    if not variant.startswith("before"):
        config = TrainerConfig(
            learning_rate=1e-6,
            micro_batch_size=8,
            micro_batch_tokens=4096,
            compute_dtype=dtype,
            packing="on" if packing else "off",
        )
        trainer = Trainer(model, config)
    times, metrics = [], {}
    pairs = attention_pairs(step_rows(groups).rows, trainer.config) if trainer is not None else (0, 0)
    for _ in range(4 if cuda else 1):
        started = time.perf_counter()
        if trainer is None:
            metrics = baseline_step(model, groups, 8, getattr(torch, dtype))
        else:
            metrics = trainer.train_step(groups)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    seconds = sorted(times[1:])[len(times[1:]) // 2] if cuda else times[0]
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "variant": variant,
        "policy": policy,
        "device": device,
        "peak_gib": peak / 2**30,
        "step_seconds": seconds,
        "padding_share": metrics["padding_share"],
        "attention_pairs_dense": pairs[0],
        "attention_pairs_varlen": pairs[1],
        "tokens_per_second": metrics["tokens"] / seconds,
    }


def fsdp_step(rows: int, completion: int) -> dict[str, Any]:
    """One step on 2 FSDP ranks (gloo, Ray actors): each rank's peak resident memory."""
    import ray

    from spotrl_runtime.training.group import TrainerGroup

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    config = TrainerConfig(learning_rate=1e-6, micro_batch_size=8, micro_batch_tokens=4096)
    group = TrainerGroup(STEP_POLICY, config, ranks=2, cpus_per_rank=1.0)
    try:
        group.start(timeout=900)
        vocab = load_policy_config_vocab()
        started = time.perf_counter()
        metrics = group.train_step(step_groups(vocab, rows, completion))
        seconds = time.perf_counter() - started
        peaks = [_vm_hwm(pid) for pid in group.pids]
    finally:
        group.shutdown()
        ray.shutdown()
    return {"variant": "after, 2 FSDP ranks", "peak_rss_gib_per_rank": peaks, "step_seconds": seconds, **metrics}


def load_policy_config_vocab() -> int:
    from transformers import AutoConfig

    from spotrl_runtime.models import resolve_model_dir

    return int(AutoConfig.from_pretrained(resolve_model_dir(STEP_POLICY)).vocab_size)


def _vm_hwm(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def in_child(kind: str, args: argparse.Namespace, policy: str = "0.5b") -> dict[str, Any]:
    command = [
        sys.executable,
        __file__,
        "--child",
        kind,
        "--rows",
        str(args.rows),
        "--completion",
        str(args.completion),
    ]
    out = subprocess.run(
        [*command, "--device", args.device, "--policies", policy], check=False, capture_output=True, text=True
    )
    if out.returncode != 0:
        why = "killed (SIGKILL: out of memory?)" if out.returncode == -9 else out.stderr.strip().splitlines()[-1:]
        return {"variant": kind, "policy": policy, "error": why}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="movement,step,fsdp")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--completion", type=int, default=384)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--policies", default="0.5b", help="0.5b and/or 1.5b (Qwen2.5 shapes, random weights)")
    parser.add_argument("--variants", default="before fp32,after fp32,before bf16,after bf16")
    parser.add_argument("--out", help="also write the step results here as JSON")
    add_check(parser)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "fsdp":
        print(json.dumps(fsdp_step(args.rows, args.completion)))
        return
    if args.child:
        print(json.dumps(one_step(args.child, args.rows, args.completion, args.device, args.policies)))
        return
    only = set(args.only.split(","))
    targets = Targets()
    if "movement" in only:
        print("== weights moved in 6 steps at lr 1e-6 (builtin:tiny-chat)")
        for r in movement():
            print(
                f"  {r['run']:20} L2 {r['moved']:.3e}  entries changed {r['changed']:.3f}  vs fp32 {r['vs_fp32']:.2f}x"
            )
    if "step" in only:
        memory = "peak GPU memory" if args.device.startswith("cuda") else "peak RSS"
        results = []
        for policy in args.policies.split(","):
            print(f"== one step, random {policy} (Qwen2.5 shape), {args.rows} rows of 128 + up to {args.completion}")
            rows = [in_child(v, args, policy) for v in args.variants.split(",")]
            for r in rows:
                if "error" in r:
                    print(f"  {r['variant']:12} failed: {r['error']}")
                    continue
                print(
                    f"  {r['variant']:12} {memory} {r['peak_gib']:6.2f} GiB  step {r['step_seconds']:7.2f} s"
                    f"  padding {r['padding_share']:.3f}  {r['tokens_per_second']:8.1f} tokens/s"
                    f"  attention pairs {r.get('attention_pairs_dense', 0) / 1e6:.2f}M dense"
                    f" ({r.get('attention_pairs_varlen', 0) / 1e6:.2f}M within rollouts)"
                )
            by = {r["variant"]: r for r in rows if "error" not in r}
            for d in ("fp32", "bf16"):
                if f"before {d}" in by and f"after {d}" in by:
                    b, a = by[f"before {d}"], by[f"after {d}"]
                    memory_ratio, time_ratio = a["peak_gib"] / b["peak_gib"], a["step_seconds"] / b["step_seconds"]
                    print(f"  {d}: {memory} after/before {memory_ratio:.2f}x, step time {time_ratio:.2f}x")
            for d in ("fp32", "bf16"):  # packing's targets (issue 59), against the padded step of this run
                if f"after {d}" in by and f"packed {d}" in by:
                    a, p = by[f"after {d}"], by[f"packed {d}"]
                    targets.at_most(f"{policy} {d}: packed padding share", p["padding_share"], 0.05)
                    targets.at_most(f"{policy} {d}: packed / padded step", p["step_seconds"] / a["step_seconds"], 0.8)
            results += rows
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2))
    if "fsdp" in only:
        r = in_child("fsdp", args)
        peaks = ", ".join(f"{p:.2f}" for p in r.get("peak_rss_gib_per_rank", []))
        print(f"== {r['variant']}: peak RSS per rank {peaks} GiB, step {r.get('step_seconds', float('nan')):.1f} s")
    targets.report(args.check)


if __name__ == "__main__":
    main()
