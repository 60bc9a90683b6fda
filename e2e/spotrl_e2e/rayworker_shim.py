"""The ``sys.executable`` of a command the fork server forked (:mod:`spotrl_e2e.forkserver`).

    python -I -S rayworker_shim.py SOCKET ARGS...

Ray starts its Python workers as ``sys.executable .../ray/_private/workers/default_worker.py
ARGS``. For those, the shim asks the fork server on ``SOCKET`` to fork the worker with its
argv, environment, working directory and standard streams, then stands in for it: the
process Ray started lives exactly as long as the worker, forwards the signals it gets, and
exits as the worker did. If the server's worker dies with the shim (the server kills it when
the shim's connection closes), a SIGKILL to the shim ends the worker as it would have ended
an exec'd one. Anything else (Ray's monitors and agents, the reward's process, the reaper)
is exec'd with this Python as asked, and so is a worker when the server cannot be reached.

Standard library only, run without ``site``: it must start in milliseconds.
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
    listen, args = sys.argv[1], sys.argv[2:]
    if not (args and args[0].endswith(RAY_WORKER)):
        exec_python(args)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(listen)
    except OSError:
        conn.close()
        exec_python(args)
    worker: list[int] = []  # its pid, once forked
    early: list[int] = []  # signals that came before

    def forward(received: int, _frame: object) -> None:
        if not worker:
            early.append(received)
            return
        with contextlib.suppress(ProcessLookupError):  # it ended; the server's answer says how
            os.kill(worker[0], received)

    for forwarded in FORWARDED:
        signal.signal(forwarded, forward)
    request = {"script": args[0], "args": args[1:], "env": dict(os.environ), "cwd": os.getcwd()}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    started = conn.recv(4096)
    if not started:
        sys.exit("rayworker_shim: the fork server closed the connection before it forked the worker")
    worker.append(json.loads(started)["pid"])
    for sig in early:
        forward(sig, None)
    ended = conn.recv(4096)
    if not ended:  # the server is gone, and its children with it
        exit_as(-signal.SIGKILL)
    exit_as(json.loads(ended)["exit"])


if __name__ == "__main__":
    main()
