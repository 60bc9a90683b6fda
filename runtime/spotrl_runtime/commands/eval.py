"""`spotrl eval -f RLJOB.yaml`: score a policy on a held-out split, as the job would ask it.

The job's prompt format, generation limits and reward are used; ``--model`` picks the policy
(default: the job's ``spec.policy.model``; give the folder ``spotrl ckpt export`` wrote to
score what a run trained) and ``--dataset`` the rows (default: the job's dataset). Greedy
decoding unless ``--samples K`` (then mean@K at ``--temperature``); ``--backend vllm``
generates with vLLM, as the job's workers do. It prints accuracy (the
share of completions whose reward is 1), the mean reward, response length and clip ratio,
and accuracy per task; ``--json`` prints them as one object. Exit code 2 for a bad flag, file
or field; 1 when the reward failed on any completion (each is counted, never scored 0).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from spotrl_runtime.commands import preflight
from spotrl_runtime.commands.preflight import UsageError


def register(sub: Any) -> None:
    p = sub.add_parser(
        "eval",
        help="score a policy on a held-out split with the job's prompt format and reward",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-f", "--filename", required=True, help="the RLJob YAML (prompt format, limits, reward)")
    p.add_argument("--model", help="the policy to score (default: spec.policy.model); e.g. a `ckpt export` folder")
    p.add_argument(
        "--dataset",
        help="the rows to score: a JSONL or Parquet file or save_to_disk folder (default: spec.dataset.uri)",
    )
    p.add_argument("--limit", type=preflight.positive_int, help="score the first N rows only")
    p.add_argument("--samples", type=preflight.positive_int, default=1, help="completions a prompt (1: greedy)")
    p.add_argument("--temperature", type=preflight.temperature, default=1.0, help="with --samples > 1 (default 1.0)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument(
        "--backend",
        choices=("transformers", "vllm"),
        default="transformers",
        help="what generates: transformers (default) or vllm (its CPU build on cpu, its CUDA build on cuda)",
    )
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    job = preflight.load_rljob_file(args.filename)
    if args.dataset is not None:
        job = _with(job, "dataset", uri=args.dataset)
    if args.model is not None:
        job = _with(job, "policy", model=args.model)
    preflight.check_job_inputs(job, f"-f {args.filename}")
    if not preflight.DEVICE.fullmatch(args.device) or args.device == "auto":
        raise UsageError(f"--device {args.device!r}: use cpu or cuda[:N]")
    # vLLM (the engine, or an agent job's tool parser) logs to stdout by default, which is the
    # result's (and --json's) alone.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from spotrl_runtime.generation.evaluate import evaluate

    result = evaluate(
        job,
        limit=args.limit,
        samples=args.samples,
        temperature=args.temperature,
        device=args.device,
        backend=args.backend,
    )
    summary = result.summary()
    if args.json:
        print(json.dumps(summary | {"examples": result.examples}, sort_keys=True))
    else:
        decoding = "greedy" if args.samples == 1 else f"mean@{args.samples}, temperature {args.temperature:g}"
        print(f"{job.spec.policy.model} on {job.spec.dataset.uri} ({summary['prompts']} prompts, {decoding})")
        print(f"  accuracy          {summary['accuracy']:.3f}  ({result.correct}/{result.completions})")
        print(f"  reward mean       {summary['reward_mean']:.3f}")
        print(f"  reward failed     {summary['reward_failed']}")
        print(f"  response length   {summary['response_length_mean']:.1f} tokens")
        print(f"  clipped           {summary['response_clip_ratio']:.3f}")
        for task, acc in summary["accuracy_by_task"].items():
            print(f"  accuracy {task:<8} {acc:.3f}")
        for ex in result.examples:
            print(f"  example idx {ex['idx']} (reward {ex['reward']:g}): {ex['completion']!r}")
    return 1 if result.failed else 0


def _with(job: Any, section: str, **changes: Any) -> Any:
    """``job`` with ``spec.<section>``'s fields changed."""
    part = getattr(job.spec, section).model_copy(update=changes)
    return job.model_copy(update={"spec": job.spec.model_copy(update={section: part})})
