"""``python -m spotrl_operator [flags]``: the same as ``spotrl operator [flags]``."""

from __future__ import annotations

import argparse
import sys

from spotrl_operator.settings import add_arguments, from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m spotrl_operator", description="The SpotRL operator: runs RLJobs through spot preemptions."
    )
    add_arguments(parser)
    from spotrl_operator.main import run

    return run(from_args(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
