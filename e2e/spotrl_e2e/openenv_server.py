"""A real OpenEnv environment server for the tests: ``openenv-core`` in a virtual environment of
its own (its web UI pins libraries that clash with ours, as a user's server image would keep
them apart), pinned by ``openenv-server.txt`` and cached under ``~/.cache/spotrl/openenv/<its
digest>``, built once by whichever test gets there first (a file lock), then reused."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from spotrl_e2e.procs import free_port, port_open

REQUIREMENTS = Path(__file__).with_name("openenv-server.txt")
START_SECONDS = 240.0
"""How long a server may take to listen (importing openenv-core takes tens of seconds on a busy CPU)."""


def server_python() -> Path:
    """The interpreter of the cached server environment, built if missing."""
    digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:12]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spotrl" / "openenv"
    home = root / digest
    python = home / "bin" / "python"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (home / ".ready").exists():
            return python
        shutil.rmtree(home, ignore_errors=True)  # what a killed build left
        uv = shutil.which("uv") or f"{Path(sys.executable).parent}/uv"
        subprocess.run([uv, "venv", "-q", "--python", "python3.11", str(home)], check=True, timeout=300)
        subprocess.run(
            [uv, "pip", "install", "-q", "--python", str(python), "-r", str(REQUIREMENTS)], check=True, timeout=900
        )
        (home / ".ready").touch()
    return python


@contextlib.contextmanager
def serving(script: Path, log: Path) -> Iterator[str]:
    """Runs ``script PORT`` (an OpenEnv app) with the server environment; yields its address
    once it listens, and stops it after."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(server_python()), str(script), str(port)], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_SECONDS
        while not port_open("127.0.0.1", port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the OpenEnv server did not listen on {port}:\n{log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
