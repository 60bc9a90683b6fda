"""`spotrl audit URI`: the effective stream of a run — which prompts each step trained on.

One JSON line per step, ``{"step": N, "prompts": [idx, ...], ...}``, the last record of each
step winning (a step retrained after an abrupt loss shows its later attempt). Two runs
trained on the same prompts exactly when their effective streams are equal.

``--summary`` prints the run's exactly-once accounting instead (what the RLJob shows as
``status.accounting``), from the audit and the restore records alone: prompts trained, dropped,
filtered at admission (e.g. too long for maxModelLen), lost and trained twice (both must be
0), steps missing and retrained, groups redispatched and sibling rollouts reused by restores,
and the seconds each resume lost (from the cut it resumed from to its first trained step).
``--json`` prints it as one JSON object. Exit code 2 when a prompt was lost or trained twice, or
a step is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from spotrl_runtime.commands.ckpt import add_s3_flags, s3_options

LINE_STATS = (
    "version_mismatches",
    "generation_idle_share",
    "generation_idle_share_max",
    "refill_rounds",
    "reward_kl_penalty_mean",
)
"""The step statistics a line of ``spotrl audit`` shows where its record has them: the groups
generated off their version beside the workers' idle share, dynamic sampling's refill rounds and
the KL penalty taken from the rewards (``training.kl.inReward``)."""


def register(sub: Any) -> None:
    p = sub.add_parser("audit", help="print a run's effective stream (prompts per trained step)", description=__doc__)
    p.add_argument("uri", help="the job's storage root: a path or s3://bucket/prefix")
    p.add_argument("--all", action="store_true", help="every record, retrained steps included")
    p.add_argument("--summary", action="store_true", help="the run's exactly-once accounting, not the stream")
    p.add_argument("--json", action="store_true", help="with --summary: one JSON object")
    add_s3_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from spotrl_runtime.controller.audit_store import AuditStore
    from spotrl_runtime.storage import open_storage

    store = AuditStore(open_storage(args.uri, **s3_options(args)))
    docs = store.documents() if args.all or args.summary else store.effective()
    if not docs:
        print(f"spotrl audit: {args.uri} holds no audit records (audit/step-*/attempt-*.json)", file=sys.stderr)
        return 1
    if args.summary:
        from dataclasses import asdict

        from spotrl_runtime.core.accounting import format_summary, rollout_gap, summarize

        acc, gap = summarize(docs, store.restores()), rollout_gap(docs)
        print(json.dumps(acc.as_dict() | {"rollout_gap": asdict(gap)}) if args.json else format_summary(acc, gap))
        return 2 if acc.prompts_lost or acc.prompts_trained_twice or acc.steps_missing else 0
    for d in docs:
        line = {
            "step": d["step"],
            "prompts": d["idxs"],
            "attempt": d["attempt"],
            "weight_version": d["weight_version"],
            "reward": d.get("reward"),
        }
        for key in LINE_STATS:
            if key in d:
                line[key] = d[key]
        left = d.get("dropped") or []
        dropped = [x["idx"] for x in left if x.get("state", "dropped") == "dropped"]
        filtered = [{"idx": x["idx"], "reason": x["reason"]} for x in left if x.get("state") == "filtered"]
        if dropped:
            line["dropped"] = dropped
        if filtered:
            line["filtered"] = filtered
        print(json.dumps(line))
    return 0
