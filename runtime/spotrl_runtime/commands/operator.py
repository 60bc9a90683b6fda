"""`spotrl operator [flags]`: run the Kubernetes operator that manages RLJobs.

The flags are the operator's settings (:mod:`spotrl_operator.settings`); Kopf and the
Kubernetes client are imported only when the operator runs.
"""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    from spotrl_operator.settings import add_arguments

    p = sub.add_parser(
        "operator",
        help="run the operator (Kopf) that runs RLJobs through preemptions",
        description="Watches RLJobs, their pods and the nodes under them; takes a barrier cut before a "
        "node goes away and starts a fresh controller elsewhere. Several replicas elect one leader (a Lease).",
    )
    add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from spotrl_operator.main import run as run_operator
    from spotrl_operator.settings import from_args

    return run_operator(from_args(args))
