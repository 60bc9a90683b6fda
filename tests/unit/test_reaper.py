"""The reaper (spotrl_runtime.reaper): what a controller started in sessions of their own goes
when the controller dies, however it dies; nothing else does. Real processes, no Ray."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from spotrl_runtime.processes import in_sessions
from spotrl_runtime.reaper import parse

# A "controller": a Reaper, a session of its own with two processes (a leader and a child that
# ignores SIGTERM and SIGHUP, like an agent that outlives its parent), one unrelated session it
# does not report, and a folder; it prints the pids and then waits to be killed.
CONTROLLER = textwrap.dedent(
    """
    import subprocess, sys, time
    from spotrl_runtime.processes import in_sessions
    from spotrl_runtime.reaper import Reaper

    folder = sys.argv[1]
    reaper = Reaper()
    reaper.folder(folder)
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    stubborn += "signal.signal(signal.SIGHUP, signal.SIG_IGN); time.sleep(600)"
    leader = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; "
         f"subprocess.Popen([sys.executable, '-c', {stubborn!r}]); time.sleep(600)"],
        start_new_session=True,
    )
    reaper.session(leader.pid)
    while len(in_sessions({leader.pid})) < 2:  # the stubborn one has started
        time.sleep(0.05)
    other = subprocess.Popen(["sleep", "600"], start_new_session=True)
    print(leader.pid, other.pid, flush=True)
    if sys.argv[2] == "close":
        reaper.close()
        print("closed", flush=True)
    time.sleep(600)
    """
)


def _session_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])


def _wait(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


Controller = tuple[subprocess.Popen[str], int, int, Path]
"""(the controller, its reported session's leader, the unreported process, its folder)."""


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[Callable[[str], Controller]]:
    started: list[subprocess.Popen[str]] = []
    others: list[int] = []

    def start(mode: str) -> Controller:
        folder = tmp_path / "ray-x"
        (folder / "session").mkdir(parents=True)
        proc = subprocess.Popen(
            [sys.executable, "-c", CONTROLLER, str(folder), mode], stdout=subprocess.PIPE, text=True
        )
        started.append(proc)
        assert proc.stdout is not None
        leader, other = map(int, proc.stdout.readline().split())
        others.append(other)
        return proc, leader, other, folder

    yield start
    for proc in started:
        proc.kill()
        proc.wait()
    for pid in others:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_sigkilled_controllers_sessions_and_folders_go_with_it(controller: Callable[[str], Controller]) -> None:
    proc, leader, other, folder = controller("wait")
    assert len(in_sessions({leader})) == 2
    proc.kill()
    proc.wait()
    assert _wait(lambda: not in_sessions({leader}), 10), f"left in the session: {in_sessions({leader})}"
    assert _wait(lambda: not folder.exists(), 5)
    assert _session_of(other) == other, "a session nobody reported is left alone"


def test_close_acts_at_once_and_the_controller_lives_on(controller: Callable[[str], Controller]) -> None:
    proc, leader, other, folder = controller("close")
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "closed"
    assert not in_sessions({leader})
    assert not folder.exists()
    assert proc.poll() is None
    assert _session_of(other) == other


def test_a_signal_to_the_controllers_group_does_not_reach_the_reaper(controller: Callable[[str], Controller]) -> None:
    proc, leader, _, folder = controller("wait")
    reapers = [p for p in in_sessions({*_sessions_below(proc.pid)}) if b"spotrl_runtime.reaper" in _cmd(p)]
    assert len(reapers) == 1
    assert _session_of(reapers[0]) == reapers[0], "the reaper leads a session of its own"
    proc.kill()
    proc.wait()
    assert _wait(lambda: not in_sessions({leader}) and not folder.exists(), 10)


def _sessions_below(pid: int) -> set[int]:
    from spotrl_runtime.processes import descendants

    return {_session_of(p) for p in descendants(pid) if Path(f"/proc/{p}").exists()}


def _cmd(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_the_watchers_input_is_read_line_by_line_and_a_bad_line_is_ignored() -> None:
    sessions, folders = parse(["session 12\n", "folder /tmp/ray-a\n", "session x\n", "nonsense\n", "session 7"])
    assert sessions == {12, 7}
    assert folders == ["/tmp/ray-a"]
