"""`spotrl validate -f RLJOB.yaml`: check RLJob documents with the same model the operator uses.

Exit codes: 0 every document is valid, 1 a document is not, 2 a file cannot be read or is not
YAML (one line naming it, the line and the column)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from spotrl_runtime.api.rljob import SpecError, parse_rljob
from spotrl_runtime.commands.preflight import UsageError, yaml_documents


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
            try:
                with open(path) as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as err:
                raise UsageError(f"-f {path}: cannot read it ({getattr(err, 'strerror', None) or err})") from None
        for i, doc in enumerate(yaml_documents(text, f"-f {path}")):
            label = f"{path}#{i}"
            try:
                job = parse_rljob(doc)
            except SpecError as err:
                bad += 1
                print(f"{label}: {err}", file=sys.stderr)
                continue
            print(f"{label}: RLJob {job.name or '<unnamed>'} is valid")
    return 1 if bad else 0
