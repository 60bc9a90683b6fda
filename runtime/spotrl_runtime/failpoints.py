"""Named points where a test can hold the controller or a generation worker in a known phase.

``SPOTRL_FAILPOINTS="train.step@5=3,cut.files_written=2"`` makes the controller sleep 3 s
inside optimizer step 5 and 2 s before the next cut's manifest (``@5+``: the first step from
5 on); on arrival it writes ``$SPOTRL_FAILPOINT_DIR/<name>`` (JSON: ``step`` and the ``pid``
that arrived) so the test knows where, and which, process is there before it sends a signal.
A test that must do something while the point holds (a node joining, say) creates
``$SPOTRL_FAILPOINT_DIR/<name>.release`` to end the sleep early. Each point fires once.
Unset (production), a point costs one dictionary lookup.

Points: ``train.step`` (between taking a step's groups and committing it),
``dispatch.finish`` (a generated group of step N not yet handed to the replay buffer),
``cut.periodic`` (step N is trained and audited, its periodic cut not yet captured),
``cut.captured`` (a barrier cut's in-memory capture is done), ``cut.files_written`` (a
cut's files are in storage, its manifest is not), ``cut.committed`` (its manifest is written,
the pointer not updated), ``cut.retention`` (about to delete older cuts; the cut points' step
is the cut's trainer step) and ``redo.step`` (a resume from a delta cut
about to redo step N), and in a generation worker
``worker.generate`` (a batch of groups about to be generated; its step is the weight version
the worker holds), ``worker.stepped`` (the worker's backend just ran its Nth step, and its
groups not finished in it are in the engine), ``worker.load_weights`` (new weights received, not yet loaded into the
backend; its step is their version) and ``worker.turns_reported`` (a multi-turn worker about to step, having
reported N finished turns of its training groups' episodes, which are in flight with it). A worker reads the
variables from its Ray node's environment.
The weight sync's lifecycle (:mod:`~spotrl_runtime.generation.sync_lifecycle`): at a member,
``weights.announce`` (drained, about to announce it is ready) and ``weights.received`` (its first
bucket loaded, the rest on the wire), each with the member's channel rank as its step; at the
sender, ``weights.send`` (bucket N posted; its step is N).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

_spec: dict[str, tuple[int | None, bool, float]] | None = None


def _parse() -> dict[str, tuple[int | None, bool, float]]:
    """``name[@step[+]]=seconds``: ``@5`` fires at step 5 only, ``@5+`` at the first step >= 5."""
    out: dict[str, tuple[int | None, bool, float]] = {}
    for item in filter(None, (os.environ.get("SPOTRL_FAILPOINTS") or "").split(",")):
        name, _, seconds = item.partition("=")
        name, _, at = name.partition("@")
        onward = at.endswith("+")
        out[name.strip()] = (int(at.rstrip("+")) if at else None, onward, float(seconds or 0))
    return out


def failpoint(name: str, step: int | None = None) -> None:
    """Sleeps here if the environment asks for it (once per point), until released."""
    global _spec
    if _spec is None:
        _spec = _parse()
    if name not in _spec:
        return
    at, onward, seconds = _spec[name]
    if at is not None and (step is None or (step < at if onward else step != at)):
        return
    del _spec[name]
    folder = os.environ.get("SPOTRL_FAILPOINT_DIR")
    if not folder:
        time.sleep(seconds)
        return
    mark = Path(folder, name)
    tmp = mark.with_name(f".{name}.{os.getpid()}")
    tmp.write_text(json.dumps({"step": step, "pid": os.getpid()}))
    tmp.replace(mark)  # whole or absent, even when two processes arrive at once
    release = Path(folder, f"{name}.release")
    deadline = time.monotonic() + seconds
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
