"""The reward's process: ``python -m spotrl_runtime.rewards.child FD PID``, started by
:class:`~spotrl_runtime.rewards.runner.RewardRunner` with ``FD`` one end of its pipe and
``PID`` the controller's (unused: it says in ``ps`` whose reward this is; its environment has
no other trace of the controller's). A module of its own, so that what it sends back (scores,
failures) unpickles in the controller under the runner's names, not ``__main__``'s."""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection

from spotrl_runtime.rewards.runner import serve

if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
