"""Where built and downloaded models live on disk, and a build-once helper for them."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def model_cache_dir() -> Path:
    """``$SPOTRL_CACHE/models`` (``~/.cache/spotrl/models`` when the variable is unset)."""
    root = os.environ.get("SPOTRL_CACHE") or str(Path.home() / ".cache" / "spotrl")
    return Path(root) / "models"


PREBUILT_ENV = "SPOTRL_PREBUILT_MODELS"
"""Read-only folders (``os.pathsep``-separated) holding models built ahead of time, searched
before the cache: the runtime image sets it to the builtin models it ships, so that a fresh
controller on a new node does not build the demo policy again before it can restore."""


def prebuilt_model_dirs() -> list[Path]:
    return [Path(d) for d in os.environ.get(PREBUILT_ENV, "").split(os.pathsep) if d]


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Returns ``target``, building it first with ``build(tmp_dir)`` if it does not exist yet.
    A folder of the same name in one of :func:`prebuilt_model_dirs` is returned instead (names
    carry the recipe's hash, so the same name is the same model).

    The folder appears atomically (built in a sibling temp folder, then renamed), and an exclusive
    file lock makes concurrent processes (a controller and its Ray workers) build it once: the
    others wait and then use it. A folder that exists is complete.
    """
    for folder in prebuilt_model_dirs():
        if (folder / target.name).is_dir():
            return folder / target.name
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


def save_model_folder(model: Any, tokenizer: Any, out_dir: Path) -> None:
    """Saves a built model and its tokenizer as a Hugging Face folder, and checks that the
    weights are there: ``save_pretrained`` silently writes no config or weights on a process
    whose torch.distributed rank is not 0, and a folder without them must never be cached."""
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    missing = [n for n in ("config.json", "model.safetensors") if not (out_dir / n).is_file()]
    if missing:
        raise RuntimeError(
            f"building {out_dir.name}: save_pretrained wrote no {', '.join(missing)} (a torch.distributed rank "
            "other than 0 saves nothing: build models before joining a process group)"
        )
