"""Named points where a test can hold the controller, to stop it in a known phase.

``SPOTRL_FAILPOINTS="train.step@5=3,cut.files_written=2"`` makes the controller sleep 3 s
inside optimizer step 5 and 2 s before the next cut's manifest; on arrival it creates
``$SPOTRL_FAILPOINT_DIR/<name>`` so the test knows where the process is before it sends a
signal. Each point fires once. Unset (production), a point costs one dictionary lookup.

Points: ``train.step`` (between taking a step's groups and committing it), ``dispatch.finish``
(a generated group of step N not yet handed to the replay buffer), ``cut.captured`` (a barrier
cut's in-memory capture is done) and ``cut.files_written`` (a cut's files are in storage,
its manifest is not).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_spec: dict[str, tuple[int | None, float]] | None = None


def _parse() -> dict[str, tuple[int | None, float]]:
    out: dict[str, tuple[int | None, float]] = {}
    for item in filter(None, (os.environ.get("SPOTRL_FAILPOINTS") or "").split(",")):
        name, _, seconds = item.partition("=")
        name, _, at = name.partition("@")
        out[name.strip()] = (int(at) if at else None, float(seconds or 0))
    return out


def failpoint(name: str, step: int | None = None) -> None:
    """Sleeps here if the environment asks for it (once per point)."""
    global _spec
    if _spec is None:
        _spec = _parse()
    if name not in _spec:
        return
    at, seconds = _spec[name]
    if at is not None and step != at:
        return
    del _spec[name]
    folder = os.environ.get("SPOTRL_FAILPOINT_DIR")
    if folder:
        Path(folder, name).write_text(str(step if step is not None else ""))
    time.sleep(seconds)
