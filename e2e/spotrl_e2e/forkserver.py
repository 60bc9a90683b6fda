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

Ray's worker processes are forked from it too. A forked command's ``sys.executable`` is a
launcher (:mod:`spotrl_e2e.rayworker_shim`): Ray starts each worker with it, and the shim
asks the server for a fork that runs Ray's own ``default_worker.py`` with the shim's argv,
environment, working directory and standard streams, then stands in for it (signals
forwarded, its exit status its own). Every other program the command starts with
``sys.executable`` (Ray's monitors and agents, the reward's process) is exec'd as before.
A generation worker or trainer rank thus starts with torch and transformers loaded instead of
importing them, each one, again.
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
import tempfile
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
    "pydantic.main",  # pydantic loads its model machinery on the first model defined
    "pydantic.json_schema",
    "torchdata.stateful_dataloader",
    # What Ray imports in each driver and worker, Ray's own modules aside: its serialization
    # context's and its clients'. Not pyarrow: it starts a thread (jemalloc's) as it loads.
    "aiohttp",
    "starlette.datastructures",
    "requests",
    "jsonschema",
    "google.protobuf.json_format",
    "msgpack",
    "uvloop",
    "click",
    "psutil",
)
"""What the server imports before its first fork (a module it cannot import is skipped). Not
Ray: its core library reads the environment when it loads (a worker forked after that saw
the server's, without its job's id, and aborted). Its dependencies read none of SpotRL's or
Ray's variables when they load."""

CONSOLE_SCRIPTS = {"spotrl": "spotrl_runtime.cli"}
"""Console scripts the server runs as their module (``pyproject.toml``'s ``[project.scripts]``;
the CLI names itself ``spotrl`` whatever ``argv[0]`` is)."""

FORK_VAR = "SPOTRL_TEST_FORKSERVER"
"""Set to 0, the suites start every command with ``subprocess`` instead (to compare, or to
rule the fork server out)."""

FORK_RAY_VAR = "SPOTRL_TEST_FORKSERVER_RAY"
"""Set to 0, the forked commands' Ray starts its workers as Ray does (exec'd, each importing
what it needs)."""

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
    and forks commands from it. One reader thread takes the server's answers.

    ``ray_workers``: the commands' Ray workers are forked too (the module docstring; by
    default unless ``SPOTRL_TEST_FORKSERVER_RAY`` is 0 when the server starts); the
    server then listens on a socket in a short folder of its own (Ray's socket paths must fit
    in 107 bytes, and so must this one). ``marker``: the environment variable whose value
    :meth:`workers_with` finds the forked Ray workers by (their ``/proc/PID/environ`` is
    the server's: a fork has no environment block of its own)."""

    def __init__(
        self,
        env: Mapping[str, str],
        cwd: Path,
        start_timeout: float = 120,
        die_with_parent: bool = False,
        preload: Sequence[str] = PRELOAD,
        ray_workers: bool | None = None,
        marker: str | None = None,
    ):
        ours, theirs = socket.socketpair()
        here = str(Path(__file__).resolve().parents[1])
        server_env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))}
        self.python: str | None = None  # the forked commands' sys.executable, where Ray's workers are forked
        self._folder: str | None = None
        listen = ""
        if ray_workers if ray_workers is not None else os.environ.get(FORK_RAY_VAR, "1") != "0":
            self._folder = tempfile.mkdtemp(prefix="fork-", dir="/tmp")
            listen = os.path.join(self._folder, "sock")  # the shim's: beside it (rayworker_shim)
            self.python = _write_launcher(Path(self._folder) / "python")
        server = (
            "import sys; from spotrl_e2e.forkserver import serve; serve(int(sys.argv[1]), *sys.argv[2:4], sys.argv[4:])"
        )
        self._proc = subprocess.Popen(
            [sys.executable, "-c", server, str(theirs.fileno()), listen, marker or "", *preload],
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
        self._workers: dict[int, str | None] = {}  # live forked Ray workers: pid -> their marker's value
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
        stderr: Path | None = None,
    ) -> Child:
        """Runs ``argv`` (see :meth:`module_of`) in a fork, its stdout and stderr appended to
        ``log`` (its stderr to ``stderr`` instead, if given); as the leader of a session of its
        own if asked, and killed when the server dies if asked (the server dies with its own
        parent then)."""
        module = self.module_of(argv, env.get("PATH"))
        if module is None:
            raise ValueError(f"the fork server runs python -m MODULE or {sorted(CONSOLE_SCRIPTS)}, not {argv[:3]}")
        self._await_ready()
        for path in filter(None, (log, stderr)):
            Path(path).touch()  # there on return, as with Popen's open()
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
                "stderr": str(stderr) if stderr is not None else None,
                "new_session": new_session,
                "die_with_parent": die_with_parent,
                "executable": self.python,
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

    def workers_with(self, value: str) -> list[int]:
        """The forked Ray workers alive (not yet reaped) whose ``marker`` variable is ``value``."""
        with self._changed:
            return [pid for pid, seen in self._workers.items() if seen == value]

    def close(self) -> None:
        """Stops the server; commands still running go on (the tests stop their own)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)

    def _read(self) -> None:
        for line in self._answers:
            event = json.loads(line)
            with self._changed:
                if "ready" in event:
                    self._ready = True
                elif "started" in event:
                    self._started[event["started"]] = event["pid"]
                elif "worker" in event:
                    self._workers[event["worker"]] = event["marker"]
                elif "worker_exited" in event:
                    self._workers.pop(event["worker_exited"], None)
                else:
                    self._exits[event["exited"]] = event["exit"]
                self._changed.notify_all()
        with self._changed:
            self._closed = True
            self._changed.notify_all()


def _write_launcher(path: Path) -> str:
    """The executable a forked command sees as ``sys.executable``: the shim itself, run by this
    Python in isolated mode without ``site`` (it needs the standard library alone, and starts in
    milliseconds). No shell between: a shell would add ``PWD`` to the environment of everything
    exec'd through it (the reward's process must hold only what it was given)."""
    shim = Path(__file__).with_name("rayworker_shim.py").read_text()
    path.write_text(f"#!{sys.executable} -IS\n{shim}")
    path.chmod(0o755)
    return str(path)


def _preload(modules: Sequence[str]) -> None:
    import importlib

    for name in modules:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def _become(msg: dict[str, Any], stdio: tuple[int, int, int], preloaded_env: Mapping[str, str]) -> None:
    """In the fork: becomes the command ``msg`` asks for, on ``stdio``, then runs its module
    as `python -m` would, or its script as `python SCRIPT` would. ``preloaded_env``: what
    the preloaded libraries put in the environment when they loaded (torch's inductor names
    its cache folder), which the command would have too."""
    import runpy

    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if msg["new_session"]:
        os.setsid()
    if msg["die_with_parent"]:
        procs.die_with_parent()
    os.chdir(msg["cwd"])
    for target, fd in enumerate(stdio):
        os.dup2(fd, target)
    for fd in set(stdio) - {0, 1, 2}:
        os.close(fd)
    servers = set(os.environ.get("PYTHONPATH", "").split(os.pathsep))
    os.environ.clear()
    os.environ.update(msg["env"])
    for name, value in preloaded_env.items():
        os.environ.setdefault(name, value)
    tempfile.tempdir = None  # the preload asked for it; the command's $TMPDIR decides it
    if msg.get("executable"):
        sys.executable = msg["executable"]
    # `python -m` puts the working directory first, `python SCRIPT` the script's folder; then
    # $PYTHONPATH's entries. The server's (this module's folder among them) are not the command's.
    extra = [p for p in msg["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    first = os.path.dirname(msg["script"]) if "script" in msg else os.getcwd()
    sys.path[:] = [first, *extra, *(p for p in sys.path[1:] if p not in extra and p not in servers)]
    if "script" in msg:
        sys.argv = [msg["script"], *msg["args"]]
        runpy.run_path(msg["script"], run_name="__main__")
    else:
        sys.argv = [msg["module"], *msg["args"]]
        runpy.run_module(msg["module"], run_name="__main__", alter_sys=True)
    sys.exit(0)


def _fork(msg: dict[str, Any], stdio: tuple[int, int, int], preloaded_env: Mapping[str, str], owned: list[Any]) -> int:
    """Forks the command ``msg``. The child closes ``owned`` (the server's sockets and
    selector: none of them is the command's) and never returns: its ``SystemExit`` or error
    leaves through the server's frames (none of them catches or cleans up) to the
    interpreter, which ends the process as it ends any (threads joined, ``atexit``)."""
    pid = os.fork()
    if pid == 0:
        for thing in owned:
            thing.close()
        _become(msg, stdio, preloaded_env)
    return pid


def _say(sock: socket.socket, event: dict[str, Any]) -> None:
    """One line of JSON to the test's side."""
    sock.sendall(json.dumps(event).encode() + b"\n")


class _Server:
    """The server's state: the test's socket, Ray workers' shims (one connection each) and
    every child not yet reaped."""

    def __init__(self, sock: socket.socket, listen: str, marker: str, preloaded_env: Mapping[str, str]):
        self.sock = sock
        self.marker = marker
        self.preloaded_env = preloaded_env
        self.sel = selectors.DefaultSelector()
        self.sel.register(sock, selectors.EVENT_READ)
        self.listener: socket.socket | None = None
        if listen:
            self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self.listener.bind(listen)
            self.listener.listen(64)
            self.sel.register(self.listener, selectors.EVENT_READ)
        self.buffered = b""
        self.commands: dict[int, int] = {}  # pid: its request's number
        self.workers: dict[int, socket.socket | None] = {}  # pid: its shim's connection (None once gone)
        self.shims: dict[socket.socket, int | None] = {}  # connection: its worker's pid once forked

    def owned(self) -> list[Any]:
        return [self.sel, self.sock, *filter(None, [self.listener]), *self.shims]

    def serve(self) -> None:
        while True:
            for key, _ in self.sel.select(timeout=REAP_EVERY):
                if key.fileobj is self.sock:
                    if not self._commands():
                        return
                elif key.fileobj is self.listener:
                    conn, _ = self.listener.accept()
                    self.shims[conn] = None
                    self.sel.register(conn, selectors.EVENT_READ)
                else:
                    self._shim(key.fileobj)  # type: ignore[arg-type]
            self._reap()

    def _commands(self) -> bool:
        """The test's requests: one command each. False once the test closed its side."""
        data = self.sock.recv(1 << 20)
        if not data:
            return False
        self.buffered += data
        while b"\n" in self.buffered:
            line, self.buffered = self.buffered.split(b"\n", 1)
            msg = json.loads(line)
            out = os.open(msg["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            err = os.open(msg["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if msg.get("stderr") else out
            devnull = os.open(os.devnull, os.O_RDONLY)
            pid = _fork(msg, (devnull, out, err), self.preloaded_env, self.owned())
            for fd in {out, err, devnull}:
                os.close(fd)
            self.commands[pid] = msg["id"]
            _say(self.sock, {"started": msg["id"], "pid": pid})
        return True

    def _shim(self, conn: socket.socket) -> None:
        """A shim's request (its worker's argv, environment and standard streams), or the
        shim gone: its worker goes too, as an exec'd worker would with its process."""
        pid = self.shims[conn]
        if pid is not None:
            self._gone(conn, pid)  # it never sends more than its request
            return
        try:
            data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        except OSError:
            data, fds = b"", []
        if not data or len(fds) != 3:
            for fd in fds:
                os.close(fd)
            self._drop(conn)
            return
        msg = json.loads(data)
        msg.update(new_session=True, die_with_parent=True)
        pid = _fork(msg, (fds[0], fds[1], fds[2]), self.preloaded_env, self.owned())
        for fd in fds:
            os.close(fd)
        self.shims[conn] = pid
        self.workers[pid] = conn
        _say(self.sock, {"worker": pid, "marker": msg["env"].get(self.marker) if self.marker else None})
        try:
            conn.send(json.dumps({"pid": pid}).encode())
        except OSError:  # it died since it asked
            self._gone(conn, pid)

    def _gone(self, conn: socket.socket, pid: int) -> None:
        """The shim of worker ``pid`` is gone: so is the worker."""
        self._drop(conn)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def _drop(self, conn: socket.socket) -> None:
        pid = self.shims.pop(conn, None)
        if pid is not None and pid in self.workers:
            self.workers[pid] = None
        self.sel.unregister(conn)
        conn.close()

    def _reap(self) -> None:
        for pid in [*self.commands, *self.workers]:
            done, raw = os.waitpid(pid, os.WNOHANG)
            if not done:
                continue
            code = os.waitstatus_to_exitcode(raw)  # as Popen's
            if pid in self.commands:
                _say(self.sock, {"exited": self.commands.pop(pid), "exit": code})
                continue
            conn = self.workers.pop(pid)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.send(json.dumps({"exit": code}).encode())
                self._drop(conn)
            _say(self.sock, {"worker_exited": pid})


def serve(fd: int, listen: str, marker: str, preload: Sequence[str]) -> None:
    """The server: preloads, says it is ready, then forks one child per request (the test's
    commands, and the Ray workers their shims ask for on ``listen``, if given) and reports
    each child's pid and, once reaped, its exit status (a worker's with the value of its
    ``marker`` variable). Ends when the test closes its side."""
    before = dict(os.environ)
    _preload(preload)
    preloaded_env = {k: v for k, v in os.environ.items() if before.get(k) != v}
    sock = socket.socket(fileno=fd)
    server = _Server(sock, listen, marker, preloaded_env)
    _say(sock, {"ready": True})
    server.serve()
