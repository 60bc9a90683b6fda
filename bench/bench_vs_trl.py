"""SpotRL against TRL's GRPOTrainer on the CPU chat job, setting by setting, in one run.

    python bench/bench_vs_trl.py [--settings a,b,c] [--seeds 3] [--steps 20] [--eval-limit 0]

Both train ``examples/cpu-chat-gsm8k.yaml``'s job (without its validation passes) for
``--steps`` steps: the same model folder (builtin:tiny-chat), rows (its Parquet file), chat
template and system prompt, reward (the built-in ``gsm8k`` verifier), group size, prompts per
step, completion length, temperature, learning rate and KL weight (0). SpotRL runs as a user runs
it (``spotrl run``, its transformers backend generating one step ahead); TRL as its GRPOTrainer
does by default on a CPU (transformers' ``generate``, one batch after another). The settings:

- ``a``: today's defaults (TRL's ``dapo`` token-mean loss and group-scaled advantages, as ours);
- ``b``: PPO-style mini-batches: the step's rollouts in 4 optimizer updates, clip-higher 0.28
  (``training.miniBatches: 4``; TRL's ``steps_per_generation: 4``, ``epsilon_high``);
- ``c``: DAPO's pieces where TRL has them: clip-higher, token-mean, truncated completions out of
  the loss (``training.overlong.filter``; TRL's ``mask_truncated_completions``). Dynamic sampling,
  which TRL lacks, runs as a third row: SpotRL with it against SpotRL without it.

Setting ``a`` has a SpotRL row with ``training.packing: off`` too: packed against padded
micro-batches on this job.

Each setting runs ``--seeds`` seeds (``training.seed``; TRL's ``seed``). Reported per row, mean
and standard error over the seeds: seconds per generated token (from the end of the first step
to the end of the last: SpotRL's audit clock and its generation rate, TRL's step clock and the
token ids its reward function is handed), and the trained policy's greedy accuracy on the held-out
split (the same ``spotrl eval``; ``--eval-limit 0``: every row of it).

TRL is a benchmark-only dependency, never imported by SpotRL: the first run installs the pinned
TRL and Accelerate into ``.out/bench/trl-site`` (their other dependencies are SpotRL's own), and
only the TRL child process puts that folder on its path.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from _chat_job import chat_job
from _targets import Targets, add_check

ROOT = Path(__file__).resolve().parents[1]
HELD_OUT = ROOT / "examples" / "data" / "word-problems" / "test.parquet"
TRL_PINS = ("trl==1.16.0", "accelerate==1.16.0")
SITE = ROOT / ".out" / "bench" / "trl-site"
MINI_BATCHES = 4
TIME_GOAL = 0.75
"""SpotRL's time per generated token against TRL's, at most, in every setting (issue 59)."""


@dataclass(frozen=True)
class Setting:
    """One row of the table: SpotRL's spec fields, and TRL's GRPOConfig fields (None: SpotRL only)."""

    name: str
    ours: dict[str, Any]
    theirs: dict[str, Any] | None


DAPO = {
    "training.clipEpsilonHigh": 0.28,
    "training.lossAggregation": "token-mean",
    "training.overlong": {"filter": True},
}
SETTINGS: dict[str, list[Setting]] = {
    "a": [Setting("a: defaults", {}, {}), Setting("a: padded (packing off)", {"training.packing": "off"}, None)],
    "b": [
        Setting(
            f"b: {MINI_BATCHES} mini-batches, clip-higher",
            {"training.miniBatches": MINI_BATCHES, "training.clipEpsilonHigh": 0.28},
            {"steps_per_generation": MINI_BATCHES, "epsilon_high": 0.28},
        )
    ],
    "c": [
        Setting(
            "c: DAPO's loss pieces",
            DAPO,
            {"epsilon_high": 0.28, "loss_type": "dapo", "mask_truncated_completions": True},
        ),
        Setting("c: + dynamic sampling", {**DAPO, "training.sampling": {"dynamic": {"maxRounds": 3}}}, None),
    ],
}


def job_file(work: Path, steps: int, seed: int, fields: dict[str, Any]) -> Path:
    """The example's job (no validation passes) with ``fields`` (``"a.b"`` under ``spec``) set."""
    path = chat_job(work / f"job-{len(list(work.glob('job-*.yaml')))}.yaml", steps)
    doc = yaml.safe_load(path.read_text())
    for key, value in {**fields, "training.seed": seed}.items():
        node = doc["spec"]
        *parents, leaf = key.split(".")
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
    path.write_text(yaml.safe_dump(doc))
    return path


def spotrl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "spotrl_runtime.cli", *args], capture_output=True, text=True)


def evaluate(job: Path, model: Path | str, limit: int) -> float:
    extra = ["--limit", str(limit)] if limit else []
    out = spotrl("eval", "-f", str(job), "--model", str(model), "--dataset", str(HELD_OUT), *extra, "--json")
    if out.returncode not in (0, 1):
        raise RuntimeError(f"spotrl eval failed: {out.stderr[-2000:]}")
    return float(json.loads(out.stdout)["accuracy"])


def run_spotrl(work: Path, job: Path, limit: int) -> dict[str, float]:
    """``spotrl run``; seconds per token generated between its first step's end and its last's."""
    storage = work / f"spotrl-cuts-{job.stem}"
    out = spotrl("run", "-f", str(job), "--storage", str(storage))
    if out.returncode != 0:
        raise RuntimeError(f"spotrl run failed: {out.stderr[-3000:]}")
    records = sorted(
        (json.loads(p.read_text()) for p in (storage / "audit").glob("step-*/attempt-*.json")), key=lambda r: r["at"]
    )
    # Each step's generation rate is over the time since the step before it.
    tokens = sum(r["generation_tokens_per_second"] * (r["at"] - q["at"]) for q, r in itertools.pairwise(records))
    exported = work / f"spotrl-policy-{job.stem}"
    out = spotrl("ckpt", "export", str(storage), "-f", str(job), "--out", str(exported))
    if out.returncode != 0:
        raise RuntimeError(f"spotrl ckpt export failed: {out.stderr[-2000:]}")
    return {
        "seconds_per_token": (records[-1]["at"] - records[0]["at"]) / tokens,
        "accuracy": evaluate(job, exported, limit),
        # What DAPO's pieces acted on: completions cut off and masked, groups filtered and refilled.
        "overlong_filtered": sum(r.get("overlong_filtered", 0.0) for r in records),
        "dynamic_filtered": sum(r.get("dynamic_filtered", 0.0) for r in records),
        "padding_share": sum(r.get("padding_share", 0.0) for r in records) / len(records),
    }


def ensure_trl() -> None:
    if (SITE / "trl").is_dir():
        return
    SITE.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["uv", "pip", "install", "--python", sys.executable, "--target", str(SITE), "--no-deps", *TRL_PINS], check=True
    )


def run_trl(work: Path, job: Path, config: dict[str, Any], limit: int) -> dict[str, float]:
    ensure_trl()
    out_dir = work / f"trl-policy-{job.stem}"
    env = {**os.environ, "PYTHONPATH": f"{SITE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    child = subprocess.run(
        [sys.executable, __file__, "--trl-child", str(job), "--trl-config", json.dumps(config), "--out", str(out_dir)],
        capture_output=True,
        text=True,
        env=env,
    )
    if child.returncode != 0:
        raise RuntimeError(f"TRL run failed: {child.stderr[-3000:]}")
    report = json.loads(child.stdout.strip().splitlines()[-1])
    return {**report, "accuracy": evaluate(job, out_dir, limit)}


def trl_child(job: Path, config: dict[str, Any], out_dir: Path) -> dict[str, float]:
    """Runs in the child that has TRL on its path: GRPOTrainer on the job's settings and ``config``."""
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from spotrl_runtime.api.rljob import parse_rljob
    from spotrl_runtime.core.types import Prompt
    from spotrl_runtime.models import resolve_model_dir
    from spotrl_runtime.rewards.loading import load_reward

    spec = parse_rljob(yaml.safe_load(job.read_text())).spec
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
    generated: list[tuple[float, int]] = []  # (when, tokens) of each generation batch scored

    def reward(completions: list[Any], answer: list[str], completion_ids: list[list[int]], **_: Any) -> list[float]:
        generated.append((time.monotonic(), sum(len(ids) for ids in completion_ids)))
        return [float(score(Prompt(0, "t", "", a), c[0]["content"])) for c, a in zip(completions, answer, strict=True)]

    gen, train = spec.generation, spec.training
    updates = int(config.get("steps_per_generation", 1))
    args = GRPOConfig(
        output_dir=str(out_dir.parent / f"trl-run-{job.stem}"),
        use_cpu=True,
        per_device_train_batch_size=gen.prompts_per_step * gen.group_size // updates,
        num_generations=gen.group_size,
        max_completion_length=gen.max_new_tokens,
        temperature=gen.temperature,
        learning_rate=train.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=train.weight_decay,
        max_grad_norm=train.max_grad_norm,
        beta=train.kl_coef,
        max_steps=train.total_steps * updates,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=train.seed,
        dataloader_num_workers=0,
        **config,
    )
    ends: list[float] = []

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, *a: Any, **k: Any) -> None:
            ends.append(time.monotonic())

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
    # From the end of the first step (its generation batch trained) to the end of the last: the
    # tokens of every generation batch after the first.
    tokens = sum(n for _, n in generated[1:])
    return {"seconds_per_token": (ends[-1] - ends[updates - 1]) / tokens}


def mean_se(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default="a,b,c")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eval-limit", type=int, default=0, help="held-out rows scored (0: all)")
    add_check(parser)
    parser.add_argument("--trl-child", help=argparse.SUPPRESS)
    parser.add_argument("--trl-config", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_child:
        print(json.dumps(trl_child(Path(args.trl_child), json.loads(args.trl_config), Path(args.out))))
        return
    results: list[tuple[str, str, list[dict[str, float]]]] = []
    targets = Targets()
    with tempfile.TemporaryDirectory(prefix="bench-vs-trl-") as tmp:
        work = Path(tmp)
        base = evaluate(job_file(work, args.steps, 0, {}), resolve_builtin(), args.eval_limit)
        for key in args.settings.split(","):
            for setting in SETTINGS[key]:
                ours, theirs = [], []
                for seed in range(args.seeds):
                    job = job_file(work, args.steps, seed, setting.ours)
                    ours.append(run_spotrl(work, job, args.eval_limit))
                    if setting.theirs is not None:
                        theirs.append(run_trl(work, job, setting.theirs, args.eval_limit))
                    print(
                        f"{setting.name} seed {seed}: SpotRL {ours[-1]}, TRL {theirs[-1] if theirs else '-'}",
                        flush=True,
                    )
                results.append((setting.name, "SpotRL", ours))
                if theirs:
                    results.append((setting.name, "TRL", theirs))
    print(f"== the CPU chat job, {args.steps} steps, {args.seeds} seeds; held-out accuracy before training {base:.3f}")
    print(f"  {'setting':34} {'who':7} {'ms / generated token':>22} {'held-out accuracy':>20}")
    for name, who, runs in results:
        (t, t_se), (a, a_se) = (
            mean_se([1000 * r["seconds_per_token"] for r in runs]),
            mean_se([r["accuracy"] for r in runs]),
        )
        print(f"  {name:34} {who:7} {t:13.3f} ± {t_se:6.3f} {a:12.3f} ± {a_se:5.3f}")
    by_name: dict[str, dict[str, list[dict[str, float]]]] = {}
    for name, who, runs in results:
        by_name.setdefault(name, {})[who] = runs
    for name, rows in by_name.items():
        if "TRL" not in rows:
            continue
        (t1, _), (t2, _) = (mean_se([r["seconds_per_token"] for r in rows[w]]) for w in ("SpotRL", "TRL"))
        (a1, s1), (a2, s2) = (mean_se([r["accuracy"] for r in rows[w]]) for w in ("SpotRL", "TRL"))
        gap = a2 - a1
        print(
            f"  {name}: SpotRL / TRL time per generated token {t1 / t2:.2f}x; accuracy {a1 - a2:+.3f} "
            f"({'significantly below' if gap > 2 * math.hypot(s1, s2) else 'not significantly below'} TRL's, 2 SE)"
        )
        targets.at_most(f"{name}: SpotRL / TRL time per generated token", t1 / t2, TIME_GOAL)
        # Not significantly below: TRL's accuracy less SpotRL's within 2 standard errors of the difference.
        targets.at_most(f"{name}: TRL's accuracy - SpotRL's, in 2 SE", gap / (2 * math.hypot(s1, s2) or math.nan), 1.0)
    targets.report(args.check)


def resolve_builtin() -> Path | str:
    from spotrl_runtime.models import resolve_model_dir

    return resolve_model_dir("builtin:tiny-chat")


if __name__ == "__main__":
    main()
