"""What SIGINT (Ctrl-C) and SIGTERM do to a controller process (`spotrl run`, `spotrl controller`).

The first of either stops the run the way a preemption notice does: a barrier cut of every
owner is committed, then the process exits with 128 + the signal's number, as a shell reports
a process the signal stopped: 130 for SIGINT, 143 for SIGTERM. Before training runs
(restoring, starting Ray) start-up just ends, with the same code: nothing happened since the
cut it restores from.

A barrier cut takes seconds (a large policy's, more), and someone at a terminal who presses
Ctrl-C wants to know it was heard and how to get out. Each further Ctrl-C goes one step on:

====  ======================================================================================
1st   ``SIGINT: taking a barrier cut, then stopping``: the barrier starts
2nd   ``cutting, press Ctrl-C again to abort ...``: a warning, nothing else changes
3rd   ``aborted ...``: stops at once without the cut. Ray's processes, the generation
      workers and the trainer ranks are killed, the cut being written is left without its
      manifest (never resumed from; retention removes it), the last committed cut stands,
      exit 130
====  ======================================================================================

The warning step is there so that one impatient double press never throws the cut away.
More SIGTERMs do nothing: kubelet and systemd send one and then SIGKILL, and a resent
SIGTERM must not cost the cut. A Ctrl-C after a SIGTERM goes on from the 2nd step.

Ray's processes start in sessions of their own (:mod:`spotrl_runtime.generation.cluster`):
a signal to the controller's process group (Ctrl-C in its terminal, ``kill -- -PGID``, Slurm
or systemd signalling a process group) reaches the controller alone, and Ray, the workers and
the ranks live on until the controller has its cut and stops them. A signal sent to every
process of a cgroup (systemd's ``KillMode=control-group``) reaches them all; use
``KillMode=mixed`` there, which signals the main process only.

:class:`SignalCount` is the decision alone (no I/O); :class:`StopSignals` installs it.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NoReturn

Action = Literal["stop", "warn", "abort", "ignore"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass
class SignalCount:
    """The signals a controller has had, and what the next one does (see the module docstring)."""

    first: int | None = None
    """The signal that stopped the run (None: none yet); it decides the exit code."""
    warned: bool = False
    """The 2nd step's warning was given: the next Ctrl-C aborts."""

    def take(self, signum: int) -> Action:
        if self.first is None:
            self.first = signum
            return "stop"
        if signum != signal.SIGINT:
            return "ignore"
        if not self.warned:
            self.warned = True
            return "warn"
        return "abort"

    def exit_code(self) -> int:
        """128 + the number of the signal that stopped the run (143 when none did)."""
        return 128 + (self.first or signal.SIGTERM)


def _say(line: str) -> None:
    print(f"spotrl: {line}", file=sys.stderr, flush=True)


def abort_now(code: int) -> NoReturn:
    """Stops this process at once: every process below it (Ray's, the generation workers, the
    trainer ranks) SIGKILLed first, Ray's folders removed, then ``os._exit(code)``: nothing more
    is written, and no cut writer thread lives on to commit a cut after the abort."""
    from spotrl_runtime.generation.cluster import remove_ray_folders
    from spotrl_runtime.processes import kill_descendants

    kill_descendants()
    remove_ray_folders()
    os._exit(code)


class StopSignals:
    """SIGINT and SIGTERM handlers of a controller process. ``stop(name)`` stops the run (it
    must return at once: the barrier runs on a thread of its own) and ``says`` is what the first
    signal prints; :meth:`stop_with` changes both once there is a controller to cut. ``abort``
    is what the 3rd Ctrl-C does. Everything here runs on the main thread (handlers too), so
    nothing needs a lock."""

    def __init__(self, stop: Callable[[str], None], says: str, abort: Callable[[int], NoReturn] = abort_now) -> None:
        self.count = SignalCount()
        self._stop = stop
        self._says = says
        self._abort = abort

    def install(self) -> StopSignals:
        """Installs the handlers (call it on the main thread)."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, self.handle)
        return self

    def stop_with(self, stop: Callable[[str], None], says: str) -> None:
        """From now on, the first signal calls ``stop``; one that came already was handled."""
        self._stop, self._says = stop, says

    def exit_code(self) -> int:
        return self.count.exit_code()

    def handle(self, signum: int, _frame: object = None) -> None:
        name = signal.Signals(signum).name
        action = self.count.take(signum)
        if action == "stop":
            _say(f"{name}: {self._says} (exit {self.exit_code()})")
            self._stop(name)
        elif action == "warn":
            _say(
                "cutting, press Ctrl-C again to abort: it stops at once, without this barrier cut "
                "(the last committed cut stands)"
            )
        elif action == "abort":
            _say(f"aborted: stopping now without a barrier cut (the last committed cut stands; exit {128 + signum})")
            self._abort(128 + signum)
        else:
            first = signal.Signals(self.count.first or signum).name
            presses = "once more" if self.count.warned else "twice more"
            _say(f"{name} again: already stopping after {first} (Ctrl-C {presses}, or SIGKILL, stops at once)")
