"""LoRA (policy.lora) against full fine-tuning, in one run (issue 48).

    PYTHONPATH=e2e python bench/bench_lora.py [--only cut,step,chat,projection] [--rank 16] [--check]

**cut**: ``builtin:random-0.5b`` (Qwen2.5-0.5B's shape) in bf16, after one training step: a
barrier cut of the trainer's state through the cut writer into a local store (bytes, seconds,
median of 3), and a weight sync over the channel to a transformers worker in this process
(bytes, seconds, median of 3). Full fine-tuning holds float32 masters and AdamW's two moments
of every weight; LoRA those of the adapter (rank ``--rank`` on every linear layer) alone.

**step**: one GRPO step of the same policy in a fresh process each: seconds and peak resident
memory (the base frozen in bf16 against float32 masters, gradients and AdamW state of every weight).

**chat**: the CPU chat example (``examples/cpu-chat-gsm8k.yaml``, 60 steps) trained by full
fine-tuning at its learning rate and by ``examples/cpu-chat-gsm8k-lora.yaml`` at its (10x),
then each run's last cut exported and scored greedily on the held-out split, against the base.
Goal: LoRA's gain in accuracy at least 0.8x full fine-tuning's.

**projection**: adapter, cut and sync bytes for an 8B base (Llama-3.1-8B's shape, built on the
meta device: the exact parameter counts) at rank 16 and 32, against full fine-tuning.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from _recovery_state import table  # noqa: E402
from _targets import Targets, add_check  # noqa: E402
from bench_numerics import step_groups  # noqa: E402
from spotrl_runtime.api.rljob import Lora, Policy  # noqa: E402
from spotrl_runtime.generation.weights import unique_tensors  # noqa: E402
from spotrl_runtime.models import lora  # noqa: E402
from spotrl_runtime.training import Trainer, TrainerConfig  # noqa: E402

POLICY = "builtin:random-0.5b"
MIB = 1 << 20


def trainer_of(variant: str, rank: int, dtype: str = "bfloat16") -> Trainer:
    adapter = Lora(rank=rank) if variant == "lora" else None
    policy = Policy(model=POLICY, dtype=dtype, lora=adapter)  # type: ignore[arg-type]
    model, _, identity = lora.load_trainable(policy, "cpu")
    config = TrainerConfig(learning_rate=1e-5, micro_batch_size=4, micro_batch_tokens=2048, compute_dtype=dtype)
    return Trainer(model, config, adapter=identity)


# ----------------------------------------------------------------------------- cut and sync


def barrier_cut(trainer: Trainer, work: Path) -> tuple[float, int]:
    """A barrier cut of ``trainer`` (live tensors, as a barrier takes them) by the cut writer into
    a fresh local store: (median seconds of 3, bytes of the cut's files)."""
    from spotrl_runtime.api.times import Deadline
    from spotrl_runtime.checkpoint import CutRequest, CutWriter
    from spotrl_runtime.core.owners import Owners, RecoveryConfig
    from spotrl_runtime.data import ArithmeticDataset, PromptCollate
    from spotrl_runtime.data.loader import PromptLoader
    from spotrl_runtime.storage import LocalStorage

    owners = Owners(
        RecoveryConfig(group_size=4, prompts_per_step=8, lookahead=1),
        PromptLoader(ArithmeticDataset(100), PromptCollate(), batch_size=8),
    )
    owners.pump()
    times, size = [], 0
    for i in range(3):
        root = work / f"cut-{i}"
        writer = CutWriter(LocalStorage(root), job="bench", dataset={"uri": "builtin:arithmetic?size=100", "size": 100})
        started = time.perf_counter()
        writer.write(owners, CutRequest.barrier(Deadline.after(600)), lambda: trainer.snapshot({}, last=True))
        times.append(time.perf_counter() - started)
        trainer.wait_for_cuts()
        size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    return statistics.median(times), size


def weight_sync(trainer: Trainer, variant: str, rank: int) -> tuple[float, int]:
    """The trainer's weights to a transformers worker over the channel: (median seconds of 3, bytes)."""
    from spotrl_runtime.generation import BackendSpec
    from spotrl_runtime.generation.transformers_backend import TransformersBackend
    from spotrl_runtime.generation.weights import give_weights

    spec = BackendSpec(
        kind="transformers", model=POLICY, dtype="bfloat16", lora=Lora(rank=rank) if variant == "lora" else None
    )
    worker = TransformersBackend.from_spec(spec)
    times, sent = [], 0
    for version in (1, 2, 3):
        started = time.perf_counter()
        # As the trainer's sender sends: its live tensors (a tied one once), cast as they are packed.
        sent = give_weights(worker, trainer.trained_state(keep_vars=True), version=version, dtype="bfloat16")
        times.append(time.perf_counter() - started)
    return statistics.median(times), sent


def cut_and_sync(rank: int) -> list[tuple[Any, ...]]:
    rows = []
    for variant in ("full", "lora"):
        trainer = trainer_of(variant, rank)
        trainer.train_step(step_groups(trainer.model.config.vocab_size, 4, 64))  # AdamW's state exists
        trained = sum(t.numel() for _, t in unique_tensors(trainer.trained_state(keep_vars=True)))
        with tempfile.TemporaryDirectory() as work:
            cut_s, cut_bytes = barrier_cut(trainer, Path(work))
        sync_s, sync_bytes = weight_sync(trainer, variant, rank)
        rows.append((variant, trained, cut_bytes, cut_s, sync_bytes, sync_s))
        print(rows[-1], flush=True)
        del trainer
    full, low = rows
    return [
        *[(v, f"{n:,}", f"{b / MIB:,.1f}", f"{s:.2f}", f"{sb / MIB:,.1f}", f"{ss:.3f}") for v, n, b, s, sb, ss in rows],
        (
            "lora / full",
            f"{low[1] / full[1]:.4f}",
            f"{low[2] / full[2]:.4f}",
            f"{low[3] / full[3]:.3f}",
            f"{low[4] / full[4]:.4f}",
            f"{low[5] / full[5]:.3f}",
        ),
    ]


# ----------------------------------------------------------------------------- step


def one_step(variant: str, rank: int) -> dict[str, Any]:
    """In a fresh process: one step's seconds (the second of two) and the process's peak memory."""
    trainer = trainer_of(variant, rank)
    groups = step_groups(trainer.model.config.vocab_size, 4, 128)
    trainer.train_step(groups)
    started = time.perf_counter()
    trainer.train_step(groups)
    seconds = time.perf_counter() - started
    return {
        "variant": variant,
        "seconds": seconds,
        "peak_gib": peak_rss_gib(),
    }


def peak_rss_gib() -> float:
    """This process's own peak resident memory (VmHWM). Not ``ru_maxrss``: a child started by a
    parent that held a model reports the parent's peak there (it is kept across fork and exec)."""
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) / 2**20


def steps(rank: int) -> list[tuple[Any, ...]]:
    got = []
    for variant in ("full", "lora"):
        out = subprocess.run(
            [sys.executable, __file__, "--one-step", variant, "--rank", str(rank)],
            capture_output=True,
            text=True,
            check=True,
        )
        got.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(got[-1], flush=True)
    full, low = got
    rows: list[tuple[Any, ...]] = [(g["variant"], f"{g['seconds']:.2f}", f"{g['peak_gib']:.2f}") for g in got]
    rows.append(("lora / full", f"{low['seconds'] / full['seconds']:.3f}", f"{low['peak_gib'] / full['peak_gib']:.3f}"))
    return rows


# ----------------------------------------------------------------------------- chat


def chat(targets: Targets) -> list[tuple[Any, ...]]:
    """Both chat examples trained 60 steps, each exported and scored, and the base scored."""
    test = ROOT / "examples" / "data" / "word-problems" / "test.parquet"
    rows = []
    with tempfile.TemporaryDirectory() as work:
        base_acc = None
        for name in ("cpu-chat-gsm8k", "cpu-chat-gsm8k-lora"):
            job, store, out = ROOT / "examples" / f"{name}.yaml", Path(work) / name, Path(work) / f"{name}-out"
            started = time.perf_counter()
            spotrl("run", "-f", str(job), "--storage", str(store))
            seconds = time.perf_counter() - started
            spotrl("ckpt", "export", str(store), "-f", str(job), "--out", str(out))
            if base_acc is None:
                base_acc = score(job, test, None)
            acc = score(job, test, out)
            rows.append((name, f"{seconds:.0f}", f"{base_acc:.3f}", f"{acc:.3f}", f"{acc - base_acc:+.3f}"))
            print(rows[-1], flush=True)
    gains = [float(r[4]) for r in rows]
    targets.at_least(
        "the chat example's held-out gain, LoRA / full fine-tuning", gains[1] / gains[0] if gains[0] else math.nan, 0.8
    )
    rows.append(("lora gain / full gain", "", "", "", f"{gains[1] / gains[0]:.2f}" if gains[0] else "n/a"))
    return rows


def spotrl(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "spotrl_runtime.cli", *args], capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"spotrl {' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout


def score(job: Path, test: Path, model: Path | None) -> float:
    args = ["eval", "-f", str(job), "--dataset", str(test), "--json"]
    if model is not None:
        args += ["--model", str(model)]
    return float(json.loads(spotrl(*args))["accuracy"])


# ----------------------------------------------------------------------------- projection


def projection() -> list[tuple[Any, ...]]:
    """Llama-3.1-8B's shape on the meta device: exact counts; bytes as SpotRL holds them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    )
    rows: list[tuple[Any, ...]] = []
    with torch.device("meta"):
        full = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    # full fine-tuning: float32 masters + two AdamW moments in the cut, bf16 over the channel
    rows.append(
        ("full fine-tuning", f"{full / 1e9:.2f} B", f"{full * 12 / 2**30:,.1f} GiB", f"{full * 2 / 2**30:,.1f} GiB")
    )
    for rank in (16, 32):
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
            lora.add_adapter(model, Lora(rank=rank), base="")
        n = sum(t.numel() for t in lora.adapter_tensors(model).values())
        rows.append(
            (
                f"LoRA rank {rank}, every linear layer",
                f"{n / 1e6:.1f} M ({n * 4 / MIB:,.0f} MiB fp32)",
                f"{n * 12 / MIB:,.0f} MiB ({n / full:.4f}x)",
                f"{n * 2 / MIB:,.0f} MiB ({n / full:.4f}x)",
            )
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="projection,cut,step,chat")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--one-step", help=argparse.SUPPRESS)
    add_check(ap)
    args = ap.parse_args()
    if args.one_step:
        torch.set_num_threads(2)
        print(json.dumps(one_step(args.one_step, args.rank)))
        return
    only = args.only.split(",")
    targets = Targets()
    if "projection" in only:
        table(
            "An 8B base (Llama-3.1-8B's shape)",
            ("what trains", "parameters", "a full cut", "a weight sync"),
            projection(),
        )
    if "cut" in only:
        table(
            f"random-0.5b in bf16: barrier cut and weight sync, full vs LoRA rank {args.rank}",
            ("variant", "trained parameters", "cut MiB", "cut s", "sync MiB", "sync s"),
            cut_and_sync(args.rank),
        )
    if "step" in only:
        table(
            f"random-0.5b in bf16: one step, full vs LoRA rank {args.rank}",
            ("variant", "step s", "peak GiB"),
            steps(args.rank),
        )
    if "chat" in only:
        table(
            "The CPU chat example, 60 steps: held-out greedy accuracy",
            ("job", "run s", "base", "after", "gain"),
            chat(targets),
        )
    targets.report(args.check)


if __name__ == "__main__":
    main()
