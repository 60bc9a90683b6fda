"""A warm parent for the `spotrl` commands a test suite starts by the hundred.

Every `spotrl run` spends most of its own CPU importing torch, transformers and torch's
distributed checkpoint before it does anything the test is about; on a small CI machine,
beside a second lane, that was a third of each run. The fork server imports those libraries
once and forks each command from itself, so a command starts with them loaded (copy on
write), then runs the real `spotrl_runtime.cli` from its first line in the child, with the
command's own argv, environment, working directory and log.

Only third-party libraries are preloaded, never SpotRL's own modules: those read the
environment (failpoints, the reward's allow-list) when they load, and each command must
read its own. What a preloaded library reads from the environment when it loads is the
suite's, the same for every command (the tests give a command only SpotRL's variables,
``PYTHONPATH`` and storage keys).

The child is a child of the fork server, not of the test, so :class:`Child` gives the test
what it used from ``subprocess.Popen``: ``pid``, ``poll``, ``wait``, ``send_signal``,
``terminate``, ``kill`` and ``returncode`` (the server reaps each child and reports its
status). Signals go to the command's own pid, as before.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from spotrl_e2e import procs

PRELOAD = (
    "numpy",
    "torch",
    "torch.distributed.checkpoint",
    "transformers",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.llama.modeling_llama",
    "boto3",
    "botocore.client",
    "yaml",
    "pydantic",
)
"""What the server imports before its first fork (a module it cannot import is skipped)."""

CONSOLE_SCRIPTS = {"spotrl": "spotrl_runtime.cli"}
"""Console scripts the server runs as their module (``pyproject.toml``'s ``[project.scripts]``;
the CLI names itself ``spotrl`` whatever ``argv[0]`` is)."""

FORK_VAR = "SPOTRL_TEST_FORKSERVER"
"""Set to 0, the suites start every command with ``subprocess`` instead (to compare, or to
rule the fork server out)."""

REAP_EVERY = 0.02
"""Seconds between the server's looks for children that exited."""


class ForkServerError(RuntimeError):
    """The fork server did not start, or stopped answering."""


class Child:
    """A command the fork server started: what a test uses of ``subprocess.Popen``."""

    def __init__(self, server: ForkServer, ask: int, pid: int, args: Sequence[str]):
        self._server = server
        self._ask = ask  # its request's number: pids are reused, these are not
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_status(self._ask)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._server.wait_for_exit(self._ask, left)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The test's side: starts the server (``python forkserver.py FD``) with ``env``
    and forks commands from it. One reader thread takes the server's answers."""

    def __init__(
        self,
        env: Mapping[str, str],
        cwd: Path,
        start_timeout: float = 120,
        die_with_parent: bool = False,
        preload: Sequence[str] = PRELOAD,
    ):
        ours, theirs = socket.socketpair()
        here = str(Path(__file__).resolve().parents[1])
        server_env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))}
        server = "import sys; from spotrl_e2e.forkserver import serve; serve(int(sys.argv[1]), sys.argv[2:])"
        self._proc = subprocess.Popen(
            [sys.executable, "-c", server, str(theirs.fileno()), *preload],
            env=server_env,
            cwd=cwd,
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            preexec_fn=procs.die_with_parent if die_with_parent else None,
        )
        theirs.close()
        self._sock = ours
        self._answers = ours.makefile("rb")
        self._start_timeout = start_timeout
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        self._ready = False
        self._started: dict[int, int] = {}
        self._exits: dict[int, int] = {}
        self._next = 0
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="forkserver-reader", daemon=True)
        self._reader.start()

    def _await_ready(self) -> None:
        """The server imports :data:`PRELOAD` first (seconds); the first command waits for that."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._ready or self._closed, timeout=self._start_timeout):
                raise ForkServerError(f"the fork server was not ready within {self._start_timeout:.0f} s")
            if not self._ready:
                raise ForkServerError(f"the fork server exited ({self._proc.poll()}) before it was ready")

    @staticmethod
    def module_of(argv: Sequence[str], path: str | None = None) -> str | None:
        """The module a command runs, where the server can fork it: ``python -m MODULE ...``
        with this Python, or the ``spotrl`` console script of its environment; else None. A
        bare program name is looked up on ``path`` (the command's ``PATH``), as exec does."""
        if not argv:
            return None
        program = argv[0] if "/" in argv[0] else shutil.which(argv[0], path=path)
        if program is None or Path(program).parent != Path(sys.executable).parent:
            return None
        name = Path(program).name
        if name.startswith("python") and len(argv) > 2 and argv[1] == "-m":
            return argv[2]
        return CONSOLE_SCRIPTS.get(name)

    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: Path,
        log: Path,
        new_session: bool = False,
        die_with_parent: bool = False,
    ) -> Child:
        """Runs ``argv`` (see :meth:`module_of`) in a fork, its stdout and stderr appended to
        ``log``; as the leader of a session of its own if asked, and killed when the server
        dies if asked (the server dies with its own parent then)."""
        module = self.module_of(argv, env.get("PATH"))
        if module is None:
            raise ValueError(f"the fork server runs python -m MODULE or {sorted(CONSOLE_SCRIPTS)}, not {argv[:3]}")
        self._await_ready()
        Path(log).touch()  # there on return, as with Popen's open()
        with self._lock:
            self._next += 1
            ask = self._next
            msg = {
                "id": ask,
                "module": module,
                "args": list(argv[3 if list(argv[1:2]) == ["-m"] else 1 :]),
                "env": dict(env),
                "cwd": str(cwd),
                "log": str(log),
                "new_session": new_session,
                "die_with_parent": die_with_parent,
            }
            self._sock.sendall(json.dumps(msg).encode() + b"\n")
        with self._changed:
            if not self._changed.wait_for(lambda: ask in self._started or self._closed, timeout=60):
                raise ForkServerError("the fork server did not fork within 60 s")
            if ask not in self._started:
                raise ForkServerError(f"the fork server stopped (exit {self._proc.poll()})")
            return Child(self, ask, self._started.pop(ask), argv)

    def exit_status(self, ask: int) -> int | None:
        with self._changed:
            return self._exits.get(ask)

    def wait_for_exit(self, ask: int, timeout: float | None) -> None:
        with self._changed:
            self._changed.wait_for(lambda: ask in self._exits or self._closed, timeout=timeout)
            if ask not in self._exits and self._closed:
                raise ForkServerError(f"the fork server stopped before command {ask} exited")

    def close(self) -> None:
        """Stops the server; commands still running go on (the tests stop their own)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)

    def _read(self) -> None:
        for line in self._answers:
            event = json.loads(line)
            with self._changed:
                if "ready" in event:
                    self._ready = True
                elif "started" in event:
                    self._started[event["started"]] = event["pid"]
                else:
                    self._exits[event["exited"]] = event["exit"]
                self._changed.notify_all()
        with self._changed:
            self._closed = True
            self._changed.notify_all()


def _preload(modules: Sequence[str]) -> None:
    import importlib

    for name in modules:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def _become(msg: dict[str, Any], sock: socket.socket, preloaded_env: Mapping[str, str]) -> None:
    """In the fork: becomes the command ``msg`` asks for, then runs the CLI as `python -m` would.
    ``preloaded_env``: what the preloaded libraries put in the environment when they loaded
    (torch's inductor names its cache folder), which the command would have too."""
    import runpy
    import tempfile

    sock.close()
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if msg["new_session"]:
        os.setsid()
    if msg["die_with_parent"]:
        procs.die_with_parent()
    os.chdir(msg["cwd"])
    out = os.open(msg["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.close(devnull)
    servers = set(os.environ.get("PYTHONPATH", "").split(os.pathsep))
    os.environ.clear()
    os.environ.update(msg["env"])
    for name, value in preloaded_env.items():
        os.environ.setdefault(name, value)
    tempfile.tempdir = None  # the preload asked for it; the command's $TMPDIR decides it
    # `python -m` puts the working directory first, then $PYTHONPATH's entries; the server's
    # (this module's folder among them) are not the command's.
    extra = [p for p in msg["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.getcwd(), *extra, *(p for p in sys.path[1:] if p not in extra and p not in servers)]
    sys.argv = [msg["module"], *msg["args"]]
    runpy.run_module(msg["module"], run_name="__main__", alter_sys=True)
    sys.exit(0)


def _say(sock: socket.socket, event: dict[str, Any]) -> None:
    """One line of JSON to the test's side."""
    sock.sendall(json.dumps(event).encode() + b"\n")


def serve(fd: int, preload: Sequence[str]) -> None:
    """The server: preloads, says it is ready, then forks one child per request and reports
    each child's pid and, once reaped, its exit status. Ends when the test closes its side."""
    before = dict(os.environ)
    _preload(preload)
    preloaded_env = {k: v for k, v in os.environ.items() if before.get(k) != v}
    sock = socket.socket(fileno=fd)
    _say(sock, {"ready": True})
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    buffered = b""
    children: dict[int, int] = {}  # pid: its request's number
    while True:
        if sel.select(timeout=REAP_EVERY):
            data = sock.recv(1 << 20)
            if not data:
                return
            buffered += data
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                msg = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    _become(msg, sock, preloaded_env)
                children[pid] = msg["id"]
                _say(sock, {"started": msg["id"], "pid": pid})
        for pid in list(children):
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                _say(sock, {"exited": children.pop(pid), "exit": os.waitstatus_to_exitcode(raw)})  # as Popen's
