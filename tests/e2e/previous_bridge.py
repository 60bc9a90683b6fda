"""A job's controller of an older SpotRL release, as far as the operator can tell: that release's
kube bridge, run by ``test_version_skew.py`` in its own process with the release's ``runtime/``
first on ``PYTHONPATH`` (so every ``spotrl_runtime`` module here is the old one).

    python previous_bridge.py KUBECONFIG NAMESPACE JOB ATTEMPT CUT_ID

Its Controllable commits the cut ``CUT_ID`` at once when a barrier is asked. It prints
``bridge <the kube_bridge module's file>`` once it watches (the test checks that it is the old
release's) and ``asked <reason>`` for each request, and runs until it is stopped.

It calls only what the oldest release it runs offers (``KubeBridge(job, namespace, attempt,
api_client=...)``, ``CutInfo``'s first six fields): it is written against that release's API,
not today's.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

from kubernetes import config

from spotrl_runtime.controller import kube_bridge
from spotrl_runtime.controller.control import CutInfo


class CommitsAtOnce:
    """A Controllable whose barrier cut is ``cut_id``, committed as soon as it is asked."""

    def __init__(self, cut_id: str):
        self.cut_id = cut_id

    def request_barrier(self, reason: str, deadline: object) -> CutInfo:
        print(f"asked {reason}", flush=True)
        step = int(self.cut_id)
        return CutInfo(self.cut_id, step, f"s3://bucket-x/cuts/{self.cut_id}", "barrier", time.time(), 0.1)


def main(kubeconfig: str, namespace: str, job: str, attempt: str, cut_id: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    client = config.new_client_from_config(config_file=kubeconfig)
    kube_bridge.KubeBridge(job, namespace, int(attempt), api_client=client).start(CommitsAtOnce(cut_id))
    print(f"bridge {kube_bridge.__file__}", flush=True)
    threading.Event().wait()  # until SIGTERM


if __name__ == "__main__":
    main(*sys.argv[1:])
