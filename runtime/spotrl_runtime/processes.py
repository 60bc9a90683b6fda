"""Processes read from /proc (Linux): those below this one (what a Ray node or an aborted
controller must stop before it goes) and those in given sessions (what the reaper stops once
a controller is gone), and how to kill them so that nothing keeps running."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator


def _stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of /proc/<pid>/stat after "(comm)": state ppid pgrp session ...) of
    every process; nothing where there is no /proc."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        yield int(entry), fields


def descendants(root: int) -> list[int]:
    """Every live process below ``root``, from /proc (children before grandchildren); [] where
    there is no /proc."""
    children: dict[int, list[int]] = {}
    for pid, fields in _stats():
        with contextlib.suppress(ValueError, IndexError):
            children.setdefault(int(fields[1]), []).append(pid)
    out: list[int] = []
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def in_sessions(sessions: set[int]) -> list[int]:
    """Every live process (other than this one; a zombie is not live) whose session id is one
    of ``sessions``, from /proc; [] where there is no /proc."""
    found = []
    for pid, fields in _stats():
        with contextlib.suppress(ValueError, IndexError):
            if pid != os.getpid() and int(fields[3]) in sessions and fields[0] not in ("Z", "X"):
                found.append(pid)
    return found


def kill_all(find: Callable[[], list[int]], between: Callable[[], object] | None = None, tries: int = 3) -> None:
    """SIGKILLs every process ``find`` returns, looking again up to ``tries`` times (one may
    start another while we look); ``between`` runs after each round (to reap them, or wait)."""
    for _ in range(tries):
        left = find()
        if not left:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if between is not None:
            between()


def kill_descendants(between: Callable[[], object] | None = None, tries: int = 3) -> None:
    """SIGKILLs every process below this one (see :func:`kill_all`)."""
    kill_all(lambda: descendants(os.getpid()), between, tries)
