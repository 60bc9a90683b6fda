"""e2e/toolchain/lib.sh: two toolchain builds at once do not break each other, and a build
killed midway leaves nothing that looks built.

The fake build shares a source folder between runs, as the real ones did (build.sh used
to `rm -rf` the Kubernetes and etcd sources of the other run), and fails when another run
touched it while it slept. The control test runs it without the lock and sees that failure,
so the locked test would catch a lock that does not hold.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LIB = REPO / "e2e" / "toolchain" / "lib.sh"
BUILD = REPO / "e2e" / "toolchain" / "build.sh"

pytestmark = pytest.mark.skipif(shutil.which("flock") is None, reason="flock (util-linux) is missing")

FAKE_BUILD = r"""
set -euo pipefail
source "$LIB"
cache=$1
build_fake() {
  local out=$1 src=$cache/src/fake
  rm -rf "$src" && mkdir -p "$src"
  echo "$$" >"$src/owner"
  touch "$cache/started.$$"
  sleep "$FAKE_SECONDS"
  [[ $(cat "$src/owner") == "$$" ]] || { echo "fake: another build replaced $src" >&2; exit 1; }
  for f in a b c; do echo "$f" >"$out/$f"; chmod +x "$out/$f"; sleep 0.05; done
}
if [[ -n ${NO_LOCK:-} ]]; then
  TOOLCHAIN_PARTIAL=$cache/.partial && mkdir -p "$TOOLCHAIN_PARTIAL"
else
  toolchain_lock "$cache"
fi
step fake "$cache/fake-v1" a b c
"""


def _start(cache: Path, seconds: float, lock: bool = True) -> subprocess.Popen[str]:
    env = {**os.environ, "LIB": str(LIB), "FAKE_SECONDS": str(seconds)}
    if not lock:
        env["NO_LOCK"] = "1"
    return subprocess.Popen(
        ["bash", "-c", FAKE_BUILD, "fake-build", str(cache)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _two_at_once(cache: Path, lock: bool) -> list[tuple[int, str]]:
    procs = [_start(cache, 1.0, lock)]
    _wait_for(lambda: any(cache.glob("started.*")))
    procs.append(_start(cache, 1.0, lock))
    out = []
    for p in procs:
        text, _ = p.communicate(timeout=60)
        out.append((p.returncode, text))
    return out


def _wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _complete(cache: Path) -> bool:
    return all((cache / "fake-v1" / f).read_text() == f"{f}\n" for f in "abc")


def test_without_the_lock_two_builds_break_each_other(tmp_path: Path) -> None:
    """The control: the fake build does detect a second build running beside it."""
    results = _two_at_once(tmp_path, lock=False)
    assert any(rc != 0 and "another build replaced" in text for rc, text in results), results


def test_two_builds_at_once_both_succeed(tmp_path: Path) -> None:
    results = _two_at_once(tmp_path, lock=True)
    assert [rc for rc, _ in results] == [0, 0], results
    first, second = (text for _, text in results)
    assert "built   fake" in first
    # The second waited for the first, then found its result.
    assert "waiting for another build" in second
    assert "cached  fake" in second
    assert _complete(tmp_path)
    assert list((tmp_path / ".partial").iterdir()) == []


def test_a_killed_build_leaves_nothing_that_looks_built(tmp_path: Path) -> None:
    p = _start(tmp_path, 60.0)
    _wait_for(lambda: any(tmp_path.glob("started.*")))
    assert not (tmp_path / "fake-v1").exists()
    os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=10)
    assert not (tmp_path / "fake-v1").exists()
    assert list((tmp_path / ".partial").iterdir()), "the killed build's scratch folder should be there"

    # The next build clears the scratch and builds it whole.
    again = _start(tmp_path, 0.0)
    text, _ = again.communicate(timeout=60)
    assert again.returncode == 0, text
    assert "built   fake" in text
    assert _complete(tmp_path)
    assert list((tmp_path / ".partial").iterdir()) == []


def test_build_sh_waits_for_the_lock(tmp_path: Path) -> None:
    """The real build.sh takes the same lock before its first step (every tool already
    "built" here as a stub, so it has nothing to do once it gets the lock)."""
    env = {**os.environ, "SPOTRL_TOOLS_DIR": str(tmp_path)}
    listed = subprocess.run([str(BUILD), "--env"], env=env, capture_output=True, text=True, check=True).stdout
    for line in listed.splitlines():
        tool = Path(line.partition("=")[2])
        for path in (tool, tool.parent / "venv" / "bin" / "python"):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("#!/bin/sh\n")
            path.chmod(0o755)
    with open(tmp_path / ".toolchain.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        p = subprocess.Popen([str(BUILD)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(1.0)
        assert p.poll() is None, p.communicate()[0]
        fcntl.flock(held, fcntl.LOCK_UN)
        text, _ = p.communicate(timeout=30)
    assert p.returncode == 0, text
    assert "waiting for another build" in text
    assert "everything cached" in text
