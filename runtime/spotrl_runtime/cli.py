"""The `spotrl` command. Each subcommand lives in its own module under ``commands/``.

Modules are imported when the CLI starts, but each one imports its heavy dependencies
(torch, kopf, boto3) inside the function that runs it, so `spotrl validate` stays fast and
works where only the operator's dependencies are installed.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# One line per subcommand module; each module defines `register(subparsers)`.
COMMAND_MODULES = (
    "spotrl_runtime.commands.validate",
    "spotrl_runtime.commands.run",
    "spotrl_runtime.commands.audit",
    "spotrl_runtime.commands.controller",
    "spotrl_runtime.commands.worker",
    "spotrl_runtime.commands.ckpt",
    "spotrl_runtime.commands.operator",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spotrl",
        description="RL post-training on spot GPUs that never loses work to a preemption.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
