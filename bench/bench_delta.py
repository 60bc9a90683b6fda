"""Delta barrier cuts against full ones: barrier time, resume time, and what fits which notice.

1. **Barrier time**, in this process, on this machine's disk, for the ~100M random policy and a
   ~1B one (fp32 weights, AdamW's two moments: 12 bytes a parameter), through the one cut
   writer, the owners of a realistic run (16 prompts a step, groups of 8, 256-token completions)
   and a redo log of ``--redo-steps`` steps since the newest full cut: a full barrier cut (the
   trainer's live tensors written as they are, as a barrier does) against a delta. Median of
   ``--repeat``. The ratio delta/full is the result (the issue's goal: ≤ 0.05, and ≤ 1 s).
2. **Resume time** to the first new step for the ~100M policy: restore of a full cut at step
   k against restore of a delta at step k on the full cut of step 0, which then redoes its k
   steps (no generation; the fingerprints checked). Small rows here (32 tokens), as training
   them on 2 CPU cores must stay short; the redo's cost scales with what a step trains.
3. **A projection** to 8B and 70B at 1, 3 and 10 GB/s from one node to S3: a full cut's bytes at
   12 bytes a parameter over the bandwidth plus the fixed part measured here, against a delta's
   measured bytes per redo step; which of a 30 s (GCE, Azure) and a 120 s (AWS) notice each fits.

    python bench/bench_delta.py [--policies 100m,1b] [--repeat 3] [--redo-steps 4] [--check]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from _targets import Targets, add_check
from spotrl_runtime.api.times import Deadline
from spotrl_runtime.checkpoint.restore import restore_cut
from spotrl_runtime.checkpoint.resume import load_trainer, redo
from spotrl_runtime.checkpoint.writer import CutRequest, CutWriter
from spotrl_runtime.core.owners import Owners, RecoveryConfig
from spotrl_runtime.core.redo import StepFingerprint
from spotrl_runtime.core.types import Rollout
from spotrl_runtime.data import ArithmeticDataset, PromptCollate, describe_dataset
from spotrl_runtime.data.loader import PromptLoader
from spotrl_runtime.storage import LocalStorage
from spotrl_runtime.training import Trainer, TrainerConfig

SHAPES = {
    # hidden, intermediate, layers, heads
    "100m": (768, 1792, 12, 12),
    "1b": (2048, 5632, 18, 16),
}
CONFIG = RecoveryConfig(group_size=8, prompts_per_step=16, lookahead=1)
DATASET = ArithmeticDataset(size=10_000)
NOTICES = (30, 120)


def model(name: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    h, i, layers, heads = SHAPES[name]
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=h,
        intermediate_size=i,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        tie_word_embeddings=True,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


SMALL = RecoveryConfig(group_size=4, prompts_per_step=4, lookahead=1)
"""The resume bench's steps: small enough to train on 2 CPU cores in seconds."""


def owners(config: RecoveryConfig = CONFIG) -> Owners:
    loader = PromptLoader(DATASET, PromptCollate(), batch_size=config.prompts_per_step, shuffle=True, seed=0)
    return Owners(config, loader)


def run_steps(o: Owners, steps: int, completion: int, train: Any = None, prompt: int = 64) -> None:
    """``steps`` steps of scripted generation (``completion`` tokens a rollout); ``train``
    (groups -> fingerprint) trains them, else each gets a made-up fingerprint (the barrier
    bench writes the rows, it does not redo them)."""
    for _ in range(steps):
        while not o.step_ready():
            for d in o.pump():
                rows = [
                    Rollout(
                        group_id=d.group_id,
                        index=k,
                        prompt_token_ids=tuple(range(2, 2 + prompt)),
                        completion_token_ids=tuple((7 * k + t) % 31000 + 2 for t in range(completion)),
                        logprobs=tuple(-0.01 * (t % 50) for t in range(completion)),
                        reward=float(k % 2),
                        weight_version=d.weight_version,
                        text="x" * 8,
                        finish_reason="length",
                    )
                    for k in d.rollout_indexes
                ]
                o.finish_group(d.group_id, rows)
        groups = o.begin_step()
        fp = train(groups) if train else StepFingerprint(1.0, 1.0, "0" * 32, "cpu/1")
        o.commit_step(fingerprint=fp)


def writer(root: Path) -> CutWriter:
    from spotrl_runtime.api.rljob import Dataset

    return CutWriter(
        LocalStorage(root), job="bench", dataset=describe_dataset(Dataset(uri=DATASET.uri), DATASET), keep=100
    )


def prime_optimizer(trainer: Trainer) -> None:
    """AdamW's two moments exist (as after a first step) without a backward pass."""
    for p in trainer.model.parameters():
        p.grad = torch.zeros_like(p)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)


def barrier_times(name: str, repeat: int, redo_steps: int, work: Path) -> dict[str, Any]:
    m = model(name)
    params = sum(p.numel() for p in m.parameters())
    trainer = Trainer(m, TrainerConfig(micro_batch_size=16))
    prime_optimizer(trainer)
    o = owners()
    w = writer(work / name)
    w.write(o, CutRequest.periodic("base"), lambda: trainer.snapshot({"model": name}, last=True))
    run_steps(o, redo_steps, completion=256)
    full, delta = [], []
    full_bytes = delta_bytes = 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        cut = w.write(o, CutRequest.barrier(Deadline.after(3600), "bench", form="delta"))
        delta.append(time.perf_counter() - t0)
        delta_bytes = cut.bytes_written
        base = w.base
        t0 = time.perf_counter()
        cut = w.write(o, CutRequest.barrier(Deadline.after(3600), "bench"), lambda: trainer.snapshot({}, last=True))
        full.append(time.perf_counter() - t0)
        full_bytes = cut.bytes_written
        w.base = base  # the next delta extends the same base, with the same redo steps
        for folder in sorted((work / name / "cuts").iterdir())[1:]:
            for f in sorted(folder.rglob("*"), reverse=True):
                f.unlink() if f.is_file() else f.rmdir()
            folder.rmdir()
    return {
        "policy": name,
        "params": params,
        "full_s": statistics.median(full),
        "delta_s": statistics.median(delta),
        "full_bytes": full_bytes,
        "delta_bytes": delta_bytes,
        "full_range": (min(full), max(full)),
        "delta_range": (min(delta), max(delta)),
    }


def resume_times(redo_steps: int, work: Path) -> dict[str, float]:
    """Restore to a trainer ready for its next step: from a full cut at step k, and from a delta
    at step k on the full cut of step 0 (load the base, redo k steps)."""
    trainer = Trainer(model("100m"), TrainerConfig(micro_batch_size=16, learning_rate=1e-5))
    o = owners(SMALL)
    w = writer(work / "resume")
    state = lambda: trainer.snapshot({}, last=True)  # noqa: E731

    def train(groups: Any) -> StepFingerprint:
        return trainer.fingerprint(trainer.train_step(groups))

    w.write(o, CutRequest.periodic("base"), state)
    run_steps(o, redo_steps, completion=16, train=train, prompt=16)
    delta_id = w.write(o, CutRequest.barrier(Deadline.after(3600), form="delta")).cut_id
    full_id = w.write(o, CutRequest.barrier(Deadline.after(3600)), state).cut_id
    out = {}
    for label, cut_id in (("full", full_id), ("delta", delta_id)):
        fresh = Trainer(model("100m"), TrainerConfig(micro_batch_size=16, learning_rate=1e-5))
        loader = PromptLoader(DATASET, PromptCollate(), batch_size=SMALL.prompts_per_step, shuffle=True, seed=0)
        t0 = time.perf_counter()
        restored = restore_cut(
            LocalStorage(work / "resume"), dataset=DATASET, collate=PromptCollate(), source=loader, cut_id=cut_id
        )
        assert restored.trainer is not None
        load_trainer(fresh, restored.trainer)  # type: ignore[arg-type]
        if restored.manifest.is_delta:
            redo(fresh, restored)
        out[label] = time.perf_counter() - t0
        assert fresh.step == redo_steps
        same = all(torch.equal(a, b) for a, b in zip(fresh.model.parameters(), trainer.model.parameters(), strict=True))
        assert same, f"the {label} resume's weights differ from the trained ones"
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", default="100m,1b")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--redo-steps", type=int, default=4)
    ap.add_argument("--resume-steps", type=int, default=2, help="steps the resume bench trains, then redoes")
    add_check(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory(prefix="bench-delta-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        rows = []
        for policy in args.policies.split(","):
            rows.append(barrier_times(policy, args.repeat, args.redo_steps, work))
            gc.collect()  # the policy, its optimizer state and its cuts' buffers go before the next
        resume = resume_times(args.resume_steps, work)
    print(f"barrier cut, full against delta ({args.redo_steps} redo steps of 16x8 rollouts, 256 tokens), local disk:")
    print(f"{'policy':<8} {'params':>8} {'full s':>8} {'full MB':>9} {'delta s':>8} {'delta MB':>9} {'ratio':>7}")
    for r in rows:
        print(
            f"{r['policy']:<8} {r['params'] / 1e9:>7.2f}B {r['full_s']:>8.2f} {r['full_bytes'] / 1e6:>9.1f} "
            f"{r['delta_s']:>8.3f} {r['delta_bytes'] / 1e6:>9.2f} {r['delta_s'] / r['full_s']:>7.4f}"
        )
    print(
        f"\nresume of the 100m policy to its next step: full cut {resume['full']:.2f} s; delta (load its base, "
        f"redo {args.resume_steps} steps of 4x4 rollouts) {resume['delta']:.2f} s; "
        f"ratio {resume['delta'] / resume['full']:.2f}"
    )
    big = rows[-1]
    per_step = big["delta_bytes"] / args.redo_steps
    fixed = big["delta_s"]
    print(
        f"\nprojection (full: 12 bytes a parameter; delta: {big['delta_bytes'] / 1e6:.1f} MB for "
        f"{args.redo_steps} steps, ~{per_step / 1e6:.1f} MB a step, +{fixed:.2f} s fixed as measured):"
    )
    print(f"{'policy':<6} {'GB/s':>5} {'full s':>8} {'delta s':>8}  fits " + ", ".join(f"{n} s" for n in NOTICES))
    for size, label in ((8e9, "8B"), (70e9, "70B")):
        for gbps in (1, 3, 10):
            full_s = 12 * size / (gbps * 1e9) + fixed
            delta_s = big["delta_bytes"] / (gbps * 1e9) + fixed
            fits = ", ".join(
                f"{n} s: {'full' if full_s <= 0.8 * n else 'delta' if delta_s <= 0.8 * n else 'neither'}"
                for n in NOTICES
            )
            print(f"{label:<6} {gbps:>5} {full_s:>8.1f} {delta_s:>8.2f}  {fits}")
    targets = Targets()
    for r in rows:
        targets.at_most(f"{r['policy']}: delta barrier cut / full barrier cut", r["delta_s"] / r["full_s"], 0.05)
        targets.at_most(f"{r['policy']}: delta barrier cut s", r["delta_s"], 1.0)
    targets.report(args.check)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
