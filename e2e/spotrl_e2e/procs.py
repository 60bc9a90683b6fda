"""Processes of the test control plane: start with a log and a pid file, wait, stop.

Every server runs in its own session (process group) so that stopping it also stops what
it started. Servers started for a pytest session die with the process that started them
(``PR_SET_PDEATHSIG``), so a killed test run leaves nothing behind; servers started by
``cluster up`` outlive the command and are stopped through their pid files.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when the thread that started it exits."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


FREE_PORTS_FROM = 20000
"""The lowest port :func:`free_port` hands out: above Ray's worker ports (10002-19999 by default)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the caller binds it soon after), drawn at random
    from below the kernel's ephemeral range. A port the kernel picks (a bind to port 0) is one
    any process's outgoing connection may take before the caller binds it: in a CI run, Kueue's
    webhook port was taken so while the other lane ran, and Kueue exited with "address already
    in use"."""
    low = _ephemeral_ports_from()
    if low - FREE_PORTS_FROM < 1000:  # a kernel whose ephemeral range takes (nearly) every port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randrange(FREE_PORTS_FROM, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port on {host} in [{FREE_PORTS_FROM}, {low}) after 200 draws")


def _ephemeral_ports_from() -> int:
    """The first port of the kernel's ephemeral range (``net.ipv4.ip_local_port_range``)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def tail(path: Path, lines: int = 30) -> str:
    """The last lines of a log file, for error messages."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError as err:
        return f"(no log: {err})"
    return "\n".join(text.splitlines()[-lines:])


class StartupError(RuntimeError):
    """A server did not come up; the message holds the tail of its log."""


class Process:
    """One server process with its log file (``<dir>/<name>.log``) and pid file (``<name>.pid``)."""

    def __init__(self, name: str, argv: Sequence[object], workdir: Path, env: Mapping[str, str] | None = None):
        self.name = name
        self.argv = [str(a) for a in argv]
        self.workdir = workdir
        self.env = dict(env) if env is not None else None
        self.log = workdir / f"{name}.log"
        self.pidfile = workdir / f"{name}.pid"
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self, detached: bool = False) -> Process:
        """Starts the process. ``detached``: it outlives this Python process (``cluster up``)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                env=self.env,
                start_new_session=True,
                preexec_fn=None if detached else die_with_parent,
            )
        self.pidfile.write_text(f"{self.popen.pid}\n")
        return self

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def exit_code(self) -> int | None:
        """None while it runs."""
        return self.popen.poll() if self.popen else None

    def log_tail(self, lines: int = 30) -> str:
        return tail(self.log, lines)

    def wait_ready(self, check: Callable[[], bool], timeout: float, what: str) -> None:
        """Polls ``check`` until it is true; fails fast if the process exits."""
        deadline = time.monotonic() + timeout
        while True:
            code = self.exit_code()
            if code is not None:
                raise StartupError(
                    f"{self.name} exited with code {code} before it was {what}; its log ({self.log}) ends:\n"
                    f"{self.log_tail()}"
                )
            with contextlib.suppress(Exception):
                if check():
                    return
            if time.monotonic() > deadline:
                raise StartupError(
                    f"{self.name} was not {what} within {timeout:.0f} s; its log ({self.log}) ends:\n{self.log_tail()}"
                )
            time.sleep(0.1)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM to its process group, SIGKILL after ``timeout``; removes the pid file."""
        if self.popen is not None and self.popen.poll() is None:
            _signal_group(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_group(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
        self.pidfile.unlink(missing_ok=True)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def process_state(pid: int) -> str | None:
    """A process's state letter (R, S, T: stopped, Z: dead, not yet reaped), None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def ray_processes_on(ip: str) -> list[str]:
    """Live processes of the Ray node bound to ``ip`` ("pid: command line"). Pods and worker
    nodes share this host, each on a loopback address of its own: this is what is left of one."""
    bound = re.compile(rf"--node[-_]ip[-_]address[= ]{re.escape(ip)}(\s|$)")
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and bound.search(cmd := _cmdline(int(proc.name))):
            out.append(f"{proc.name}: {cmd[:160]}")
    return out


def stop_pidfile(pidfile: Path, expect_in_cmdline: str, timeout: float = 10.0) -> bool:
    """Stops the process group a pid file names, if its command line still contains ``expect_in_cmdline``
    (a recycled pid is left alone). Returns whether something was stopped."""
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return False
    stopped = False
    if expect_in_cmdline in _cmdline(pid):
        _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and expect_in_cmdline in _cmdline(pid):
            time.sleep(0.1)
        if expect_in_cmdline in _cmdline(pid):
            _signal_group(pid, signal.SIGKILL)
        stopped = True
    pidfile.unlink(missing_ok=True)
    return stopped
