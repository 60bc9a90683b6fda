"""The ``sys.executable`` of a command the fork server forked (:mod:`spotrl_e2e.forkserver`).

The server copies this file into its folder as ``python``, under a ``#!PYTHON -IS`` line, beside
its socket ``sock``. Ray starts each Python worker as ``sys.executable
.../ray/_private/workers/default_worker.py ARGS``; for that script the shim asks the server for a
fork that runs it with the shim's argv, environment, working directory and standard streams, then
stands in for it. The process Ray started lives as long as the worker, forwards the signals it
gets, and exits as the worker did. When the shim dies (a SIGKILL too), the server kills the
worker, as the worker would have died with its own process. Anything else (Ray's monitors and
agents, the reward's process, the reaper) is exec'd with this Python as asked, and so is a worker
when the server cannot be reached.

Standard library only, isolated and without ``site``: it must start in milliseconds and change
nothing in what it execs (no shell between, which would add ``PWD`` to the environment).
"""

import contextlib
import json
import os
import signal
import socket
import sys

RAY_WORKER = os.path.join("ray", "_private", "workers", "default_worker.py")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def exec_python(args: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *args])


def exit_as(code: int) -> None:
    """Ends this process as the worker ended: its exit code, or its signal."""
    if code < 0:
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


def main() -> None:
    listen, args = os.path.join(os.path.dirname(sys.argv[0]), "sock"), sys.argv[1:]
    if not (args and args[0].endswith(RAY_WORKER)):
        exec_python(args)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(listen)
    except OSError:
        conn.close()
        exec_python(args)
    # Signals wait (blocked) until the worker's pid is known, then reach it.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    request = {"script": args[0], "args": args[1:], "env": dict(os.environ), "cwd": os.getcwd()}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    started = conn.recv(4096)
    if not started:
        sys.exit("rayworker_shim: the fork server closed the connection before it forked the worker")
    pid = json.loads(started)["pid"]

    def forward(received: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):  # it ended; the server's answer says how
            os.kill(pid, received)

    for forwarded in FORWARDED:
        signal.signal(forwarded, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    ended = conn.recv(4096)
    if not ended:  # the server is gone, and its children with it
        exit_as(-signal.SIGKILL)
    exit_as(json.loads(ended)["exit"])


if __name__ == "__main__":
    main()
