"""`spotrl validate -f RLJOB.yaml`: check RLJob documents with the same model the operator uses."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml

from spotrl_runtime.api.rljob import SpecError, parse_rljob


def register(sub: Any) -> None:
    p = sub.add_parser("validate", help="check RLJob documents against the API model")
    p.add_argument("-f", "--filename", required=True, action="append", help="YAML file ('-' for stdin)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    bad = 0
    for path in args.filename:
        if path == "-":
            text = sys.stdin.read()
        else:
            with open(path) as f:
                text = f.read()
        for i, doc in enumerate(d for d in yaml.safe_load_all(text) if d is not None):
            label = f"{path}#{i}"
            try:
                job = parse_rljob(doc)
            except SpecError as err:
                bad += 1
                print(f"{label}: {err}", file=sys.stderr)
                continue
            print(f"{label}: RLJob {job.name or '<unnamed>'} is valid")
    return 1 if bad else 0
