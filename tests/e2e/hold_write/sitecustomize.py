"""Loaded into an operator process by a test that needs one of its writes in flight when it is
stopped: the test puts this folder first on its ``PYTHONPATH`` (Python imports
``sitecustomize`` at start-up).

Once the file named by ``$SPOTRL_HOLD_WRITE`` exists, the next write the process's Kubernetes
client sends (any method but GET; the leader Lease's own excepted) is held
``$SPOTRL_HOLD_WRITE_SECONDS`` before it goes out, as over a slow link; the file
``$SPOTRL_HOLD_WRITE.held`` names it from the moment it is held. It holds below the client's
write guard: the write was allowed (the process led) when it was sent. Kopf's own client
(aiohttp) is not held. Each process holds one write at most.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any


def _install(arm: Path, seconds: float) -> None:
    # urllib3, under the Kubernetes client: importing ``kubernetes`` here would fix its default
    # kubeconfig before the operator sets $KUBECONFIG.
    import urllib3

    send = urllib3.PoolManager.urlopen
    lock = threading.Lock()
    fired: list[str] = []

    def urlopen(self: Any, method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        if method != "GET" and "/coordination.k8s.io/" not in url and arm.exists():
            with lock:
                first = not fired
                fired.append(url)
            if first:
                arm.with_name(arm.name + ".held").write_text(f"{method} {url}\n")
                time.sleep(seconds)
        return send(self, method, url, *args, **kwargs)

    urllib3.PoolManager.urlopen = urlopen  # type: ignore[method-assign]


if os.environ.get("SPOTRL_HOLD_WRITE"):
    _install(Path(os.environ["SPOTRL_HOLD_WRITE"]), float(os.environ.get("SPOTRL_HOLD_WRITE_SECONDS") or 2.5))
