"""Small checks tests share: is a process alive, has a file said something yet."""

from __future__ import annotations

import os
import time
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Whether a process runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (ProcessLookupError, FileNotFoundError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_file(file: Path, text: str, timeout: float = 20) -> str:
    """Waits until ``file`` contains ``text``; returns the file's content."""
    deadline = time.monotonic() + timeout
    while True:
        content = file.read_text() if file.exists() else ""
        if text in content:
            return content
        if time.monotonic() > deadline:
            raise TimeoutError(f"{file} did not contain {text!r} within {timeout:.0f} s; it holds:\n{content[-2000:]}")
        time.sleep(0.1)
