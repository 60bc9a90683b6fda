"""The processes below this one, read from /proc (Linux): what a Ray node or an aborted
controller must stop before it goes, so that nothing of it keeps running."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable


def descendants(root: int) -> list[int]:
    """Every live process below ``root``, from /proc (children before grandchildren); [] where
    there is no /proc."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def kill_descendants(between: Callable[[], object] | None = None, tries: int = 3) -> None:
    """SIGKILLs every process below this one, looking again up to ``tries`` times (a process
    may start one while we look); ``between`` runs after each round (e.g. to reap them)."""
    for _ in range(tries):
        left = descendants(os.getpid())
        if not left:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if between is not None:
            between()


def in_sessions(sessions: set[int]) -> list[int]:
    """Every live process (other than this one; a zombie is not live) whose session id is one
    of ``sessions``, from /proc; [] where there is no /proc."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    found = []
    for entry in entries:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # after "(comm)": state ppid pgrp session ...
                fields = f.read().rsplit(")", 1)[1].split()
            state, sid = fields[0], int(fields[3])
        except (OSError, ValueError, IndexError):
            continue
        if sid in sessions and state not in ("Z", "X"):
            found.append(int(entry))
    return found
