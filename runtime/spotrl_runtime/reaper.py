"""A watcher that stops what a controller started in sessions of their own when the controller
dies, however it dies (SIGKILL, an OOM kill, a crash).

Ray's processes run in sessions of their own (so that Ctrl-C reaches the controller alone),
and most die with the controller by themselves: the GCS and the raylet carry a parent-death
signal, the workers lose the raylet's socket. Ray's agents do not: after an unexpected raylet
death each tries for up to 60 s to report it to the GCS, which is dead too. So the controller
starts this watcher (:func:`watch`) in a session of its own, tells it each session to stop
and each folder to remove, one line each on its stdin, and holds the pipe's other end. When
the controller's process ends, the kernel closes that end; the watcher reads EOF, SIGKILLs
every process still in those sessions, removes the folders and exits. A controller that
stops Ray itself closes the pipe (:meth:`Reaper.close`) and the watcher finds nothing left.

Run as ``python -m spotrl_runtime.reaper``; it imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import time
from typing import IO

from spotrl_runtime.processes import in_sessions, kill_all


class Reaper:
    """The controller's end of a watcher's pipe: :meth:`session` and :meth:`folder` add to what
    the watcher stops and removes once this process is gone (or :meth:`close` is called)."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "spotrl_runtime.reaper"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # a signal to the controller's group is not for it
        )
        assert self._proc.stdin is not None
        self._pipe: IO[bytes] | None = self._proc.stdin

    def session(self, sid: int) -> None:
        self._say(f"session {sid}")

    def folder(self, path: str) -> None:
        self._say(f"folder {path}")

    def _say(self, line: str) -> None:
        if self._pipe is None:
            raise RuntimeError("the reaper was closed")
        self._pipe.write(line.encode() + b"\n")
        self._pipe.flush()

    def close(self, timeout: float = 10.0) -> None:
        """Lets the watcher act now (EOF) and waits for it to exit."""
        if self._pipe is not None:
            with contextlib.suppress(OSError):
                self._pipe.close()
            self._pipe = None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout)


def parse(lines: list[str]) -> tuple[set[int], list[str]]:
    """(sessions, folders) from the watcher's input; a line it cannot read is ignored."""
    sessions: set[int] = set()
    folders: list[str] = []
    for line in lines:
        what, _, arg = line.strip().partition(" ")
        if what == "session" and arg.isdigit():
            sessions.add(int(arg))
        elif what == "folder" and arg:
            folders.append(arg)
    return sessions, folders


def watch(stdin: IO[bytes], rounds: int = 5) -> None:
    """Reads until EOF, then SIGKILLs what is left in the sessions (looking again ``rounds``
    times: a dying raylet may still start one) and removes the folders."""
    lines: list[str] = []
    for raw in stdin:
        lines.append(raw.decode(errors="replace"))
    sessions, folders = parse(lines)
    kill_all(lambda: in_sessions(sessions), between=lambda: time.sleep(0.1), tries=rounds)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # it ends with the controller, never before
    watch(sys.stdin.buffer)
