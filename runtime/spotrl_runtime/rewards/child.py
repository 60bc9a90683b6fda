"""The reward's process: ``python -m spotrl_runtime.rewards.child FD PID``, started by
:class:`~spotrl_runtime.rewards.runner.RewardRunner` with ``FD`` one end of its pipe and
``PID`` the controller's (it also says in ``ps`` whose reward this is; its environment has no
other trace of the controller's). A module of its own, so that what it sends back (scores,
failures) unpickles in the controller under the runner's names, not ``__main__``'s."""

from __future__ import annotations

import os
import signal
import sys
from multiprocessing.connection import Connection

from spotrl_runtime.rewards.runner import serve

PR_SET_PDEATHSIG = 1


def die_with(parent: int) -> None:
    """SIGKILL this process when ``parent`` goes, however it goes (a SIGKILLed controller
    cannot close its children, and a call can run for minutes inside C code, deaf to its
    pipe's EOF). Linux only; elsewhere :meth:`RewardRunner.close` and the pipe's EOF stop it."""
    if sys.platform != "linux":
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(0)  # the controller went before the request took effect


if __name__ == "__main__":
    die_with(int(sys.argv[2]))
    serve(Connection(int(sys.argv[1])))
