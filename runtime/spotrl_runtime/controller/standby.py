"""A standby controller's wait (``spec.standby``): warm, then idle until its attempt comes.

The operator makes the next attempt's controller pod early, on another node
(:mod:`spotrl_operator.standby`). Its process starts like any controller's: it reads its RLJob
and begins Ray and the generation workers (:mod:`~spotrl_runtime.controller.prestart`). Then,
seeing ``status.attempt`` below its own, it does what else needs no claim on the job: the
controller's imports, the policy loaded for training, the workers' backends built. It claims
nothing, writes nothing and listens on no port (so the pod is not Ready, and the job's
PodDisruptionBudget does not count it) until the operator writes its attempt onto the status:
then :func:`stand_by` returns, and the controller goes on as a fresh one would, from the
restore on, with its start counted from that moment.

A SIGTERM while it waits ends it at once (:class:`StandbyStopped`): it holds no state.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spotrl_runtime.api.rljob import RLJob
    from spotrl_runtime.controller.assemble import ControllerOptions
    from spotrl_runtime.controller.kube_bridge import KubeBridge
    from spotrl_runtime.controller.prestart import Prestart

log = logging.getLogger("spotrl.controller")

Obj = dict[str, Any]


class StandbyStopped(BaseException):
    """A SIGTERM came while the standby waited. A BaseException, as KeyboardInterrupt is: the
    watch's own error handling (network trouble: watch again) must not swallow it."""


def status_attempt(rljob: Obj) -> int:
    return int((rljob.get("status") or {}).get("attempt") or 0)


def stand_by(job: RLJob, bridge: KubeBridge, options: ControllerOptions, prestart: Prestart) -> Obj:
    """Warms up, then waits for ``status.attempt`` to reach ``bridge.attempt``; returns the
    RLJob as it was then. Sets ``options.policy`` (the policy loaded) and
    ``options.started_at`` (the moment its attempt came). Raises :class:`StandbyStopped` on a SIGTERM."""
    began = time.monotonic()

    def leave(*_: object) -> None:
        raise StandbyStopped

    previous = signal.signal(signal.SIGTERM, leave)
    try:
        # What the controller imports next (torch, transformers, the checkpoint code): now.
        from spotrl_runtime.controller import assemble, loop  # noqa: F401
        from spotrl_runtime.models import load_policy
        from spotrl_runtime.models.lora import trainer_load_dtype

        if job.spec.training.parallelism.strategy != "fsdp":  # FSDP ranks load the policy themselves
            options.policy = load_policy(job.spec.policy, options.device, dtype=trainer_load_dtype(job.spec.policy))
        prestart.wait(workers=True)
        log.info(
            "standby for attempt %d: warm in %.2f s (imports, Ray, generation workers, policy); "
            "waiting for status.attempt to reach %d",
            bridge.attempt,
            time.monotonic() - began,
            bridge.attempt,
        )
        rljob = bridge.wait_for_attempt()
    finally:
        signal.signal(signal.SIGTERM, previous)
    options.started_at = time.time()
    log.info("attempt %d is on the status: the standby takes over", bridge.attempt)
    return rljob
