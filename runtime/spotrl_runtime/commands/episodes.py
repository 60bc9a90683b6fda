"""`spotrl episodes URI --step N`: a trained step's episodes, turn by turn.

For a job with ``spec.environment``: each trained step keeps its first episodes beside its audit
record. This prints them as its last attempt trained them: the prompt, then each turn, what the
policy generated (``policy``: its tool calls included) and what the environment wrote back
(``environment``: the chat template's markers included), and the episode's reward. For debugging
an environment: a tool that answers wrongly, a template that writes its answer oddly, a policy
that calls a tool the environment does not have. ``--json`` prints the stored object.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from spotrl_runtime.commands.ckpt import add_s3_flags, s3_options


def register(sub: Any) -> None:
    p = sub.add_parser("episodes", help="print a trained step's episodes, turn by turn", description=__doc__)
    p.add_argument("uri", help="the job's storage root: a path or s3://bucket/prefix")
    p.add_argument("--step", type=int, required=True, help="the trained step (0 is the first)")
    p.add_argument("--json", action="store_true", help="the stored object, as JSON")
    add_s3_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from spotrl_runtime.controller.audit_store import AuditStore
    from spotrl_runtime.storage import open_storage

    doc = AuditStore(open_storage(args.uri, **s3_options(args))).episodes(args.step)
    if doc is None:
        print(
            f"spotrl episodes: {args.uri} holds no episodes of step {args.step} (audit/episodes/step-*/); "
            "they are kept for jobs with spec.environment, for each step trained",
            file=sys.stderr,
        )
        return 1
    if args.json:
        print(json.dumps(doc))
        return 0
    print(f"step {doc['step']} (attempt {doc['attempt']}): {len(doc['episodes'])} episodes")
    for episode in doc["episodes"]:
        turns = sum(t["role"] == "policy" for t in episode["turns"])
        name = f"{episode['group_id']}/{episode['index']} (prompt {episode['prompt_idx']})"
        plural = "s" if turns != 1 else ""
        print(
            f"\n== {name}: reward {episode['reward']}, {turns} turn{plural}, {episode['finish_reason']}, "
            f"weights v{episode['weight_version']}"
        )
        print(f"-- prompt\n{episode['prompt']}")
        for turn in episode["turns"]:
            print(f"-- {turn['role']}\n{turn['text']}")
    return 0
