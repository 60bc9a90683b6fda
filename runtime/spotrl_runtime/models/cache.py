"""Where built and downloaded models live on disk, and a build-once helper for them."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def model_cache_dir() -> Path:
    """``$SPOTRL_CACHE/models`` (``~/.cache/spotrl/models`` when the variable is unset)."""
    root = os.environ.get("SPOTRL_CACHE") or str(Path.home() / ".cache" / "spotrl")
    return Path(root) / "models"


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Returns ``target``, building it first with ``build(tmp_dir)`` if it does not exist yet.

    The folder appears atomically (built in a sibling temp folder, then renamed), and an exclusive
    file lock makes concurrent processes (a controller and its Ray workers) build it once: the
    others wait and then use it. A folder that exists is complete.
    """
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if target.is_dir():
                return target
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
            try:
                build(tmp)
                os.replace(tmp, target)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target
