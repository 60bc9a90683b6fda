"""Builds the builtin demo policy into a folder ahead of time, for ``SPOTRL_PREBUILT_MODELS``.

    python -m spotrl_runtime.models.prebuild /usr/share/spotrl/models

The runtime images do this when they are built: a controller that starts on a fresh node then
finds ``builtin:tiny-arith`` ready instead of building it (seconds of every recovery) before
it can restore. ``builtin:random-*`` policies (hundreds of MB, benchmarks only) are not shipped.
"""

from __future__ import annotations

import sys
from pathlib import Path

from spotrl_runtime.models.tiny_arith import tiny_arith_dir


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m spotrl_runtime.models.prebuild FOLDER", file=sys.stderr)
        return 2
    folder = tiny_arith_dir(cache_dir=Path(args[0]))
    print(folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
