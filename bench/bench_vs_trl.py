"""SpotRL against TRL's GRPOTrainer on the CPU chat job, in one run.

    python bench/bench_vs_trl.py [--steps 20] [--eval-limit 128]

Both train ``examples/cpu-chat-gsm8k.yaml``'s job for ``--steps`` steps: the same model folder
(builtin:tiny-chat), rows (its Parquet file), chat template and system prompt, reward (the
built-in ``gsm8k`` verifier), group size, prompts per step, completion length, temperature,
learning rate and KL weight (0). SpotRL runs as a user runs it (``spotrl run``, its
transformers backend generating one step ahead); TRL as its GRPOTrainer does by default on a
CPU (transformers' ``generate``, one batch after another, its ``dapo`` token-mean loss and
group-scaled advantages, as SpotRL's). Each trained policy is then scored by the same
``spotrl eval`` on the held-out split (greedy). Reported: seconds per step (SpotRL: between its
first and last audited step; TRL: its steps' mean), the whole run's wall time, accuracy.

TRL is a benchmark-only dependency, never imported by SpotRL: the first run installs the pinned
TRL and Accelerate into ``.out/bench/trl-site`` (their other dependencies are SpotRL's own), and
only the TRL child process puts that folder on its path.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "examples" / "cpu-chat-gsm8k.yaml"
HELD_OUT = ROOT / "examples" / "data" / "word-problems" / "test.parquet"
TRL_PINS = ("trl==1.16.0", "accelerate==1.16.0")
SITE = ROOT / ".out" / "bench" / "trl-site"


def job_doc(steps: int) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(JOB.read_text())
    doc["spec"]["dataset"]["uri"] = str(ROOT / doc["spec"]["dataset"]["uri"])
    doc["spec"]["training"]["totalSteps"] = steps
    return doc


def spotrl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "spotrl_runtime.cli", *args], capture_output=True, text=True)


def evaluate(job_file: Path, model: Path, limit: int) -> float:
    out = spotrl(
        "eval", "-f", str(job_file), "--model", str(model), "--dataset", str(HELD_OUT), "--limit", str(limit), "--json"
    )
    if out.returncode not in (0, 1):
        raise RuntimeError(f"spotrl eval failed: {out.stderr[-2000:]}")
    return float(json.loads(out.stdout)["accuracy"])


def run_spotrl(work: Path, job_file: Path, steps: int, limit: int) -> dict[str, Any]:
    storage = work / "spotrl-cuts"
    started = time.monotonic()
    out = spotrl("run", "-f", str(job_file), "--storage", str(storage))
    wall = time.monotonic() - started
    if out.returncode != 0:
        raise RuntimeError(f"spotrl run failed: {out.stderr[-3000:]}")
    records = [json.loads(p.read_text()) for p in sorted((storage / "audit").glob("step-*/attempt-*.json"))]
    at = sorted(r["at"] for r in records)
    per_step = (at[-1] - at[0]) / (len(at) - 1)
    exported = work / "spotrl-policy"
    out = spotrl("ckpt", "export", str(storage), "-f", str(job_file), "--out", str(exported))
    if out.returncode != 0:
        raise RuntimeError(f"spotrl ckpt export failed: {out.stderr[-2000:]}")
    return {
        "steps": len(records),
        "seconds_per_step": per_step,
        "wall_seconds": wall,
        "accuracy": evaluate(job_file, exported, limit),
    }


def ensure_trl() -> None:
    if (SITE / "trl").is_dir():
        return
    SITE.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["uv", "pip", "install", "--python", sys.executable, "--target", str(SITE), "--no-deps", *TRL_PINS], check=True
    )


def run_trl(work: Path, job_file: Path, steps: int, limit: int) -> dict[str, Any]:
    ensure_trl()
    out_dir = work / "trl-policy"
    env = {**os.environ, "PYTHONPATH": f"{SITE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    started = time.monotonic()
    child = subprocess.run(
        [sys.executable, __file__, "--trl-child", str(job_file), "--steps", str(steps), "--out", str(out_dir)],
        capture_output=True,
        text=True,
        env=env,
    )
    wall = time.monotonic() - started
    if child.returncode != 0:
        raise RuntimeError(f"TRL run failed: {child.stderr[-3000:]}")
    report = json.loads(child.stdout.strip().splitlines()[-1])
    return {**report, "wall_seconds": wall, "accuracy": evaluate(job_file, out_dir, limit)}


def trl_child(job_file: Path, steps: int, out_dir: Path) -> dict[str, Any]:
    """Runs in the child that has TRL on its path: GRPOTrainer on the job's settings."""
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from spotrl_runtime.api.rljob import parse_rljob
    from spotrl_runtime.core.types import Prompt
    from spotrl_runtime.models import resolve_model_dir
    from spotrl_runtime.rewards.loading import load_reward

    spec = parse_rljob(yaml.safe_load(job_file.read_text())).spec
    folder = resolve_model_dir(spec.policy.model)
    rows = pq.read_table(spec.dataset.uri).to_pylist()
    system = spec.dataset.system_prompt
    dataset = Dataset.from_list(
        [
            {
                "prompt": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": r[spec.dataset.prompt_field]},
                ],
                "answer": str(r[spec.dataset.answer_field]),
            }
            for r in rows
        ]
    )
    score = load_reward(spec.reward)

    def reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
        return [float(score(Prompt(0, "t", "", a), c[0]["content"])) for c, a in zip(completions, answer, strict=True)]

    gen, train = spec.generation, spec.training
    args = GRPOConfig(
        output_dir=str(out_dir.parent / "trl-run"),
        use_cpu=True,
        per_device_train_batch_size=gen.prompts_per_step * gen.group_size,
        num_generations=gen.group_size,
        max_completion_length=gen.max_new_tokens,
        temperature=gen.temperature,
        learning_rate=train.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=train.weight_decay,
        max_grad_norm=train.max_grad_norm,
        beta=train.kl_coef,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=train.seed,
        dataloader_num_workers=0,
    )
    times: list[float] = []

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.t = time.monotonic()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            times.append(time.monotonic() - self.t)

    torch.manual_seed(train.seed)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    trainer.train()
    trainer.save_model(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return {"steps": len(times), "seconds_per_step": sum(times[1:]) / max(1, len(times) - 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eval-limit", type=int, default=128)
    parser.add_argument("--trl-child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_child:
        print(json.dumps(trl_child(Path(args.trl_child), args.steps, Path(args.out))))
        return
    with tempfile.TemporaryDirectory(prefix="bench-vs-trl-") as tmp:
        work = Path(tmp)
        job_file = work / "job.yaml"
        job_file.write_text(yaml.safe_dump(job_doc(args.steps)))
        base = evaluate(job_file, Path(str(resolve_builtin())), args.eval_limit)
        ours = run_spotrl(work, job_file, args.steps, args.eval_limit)
        theirs = run_trl(work, job_file, args.steps, args.eval_limit)
    print(f"== the CPU chat job, {args.steps} steps; held-out accuracy before training {base:.3f}")
    for name, r in (("SpotRL", ours), ("TRL GRPOTrainer", theirs)):
        print(
            f"  {name:16} {r['seconds_per_step']:6.2f} s/step  wall {r['wall_seconds']:7.1f} s"
            f"  held-out accuracy {r['accuracy']:.3f}"
        )
    print(f"  SpotRL / TRL: step time {ours['seconds_per_step'] / theirs['seconds_per_step']:.2f}x")


def resolve_builtin() -> Path | str:
    from spotrl_runtime.models import resolve_model_dir

    return resolve_model_dir("builtin:tiny-chat")


if __name__ == "__main__":
    main()
