"""Whether a barrier cut would fit the shortest notice the job may get, said before a notice
comes. Pure: part of :func:`~spotrl_operator.reconcile.reconcile`.

The controller publishes its estimate of a barrier cut's seconds (``status.cutEstimate``,
from its last cuts: :mod:`spotrl_runtime.core.cut_estimate`). The shortest window is the job's
``spec.checkpoint.barrierDeadlineSeconds`` or the smallest of the operator's
``signals.deadlineCaps``, whichever is shorter: any of those notices may come. A cloud's own
provider (``gke``, ``aks``) counts only in a cluster with nodes of that cloud: GKE's short
notice never reaches an EKS job. When the estimate does not fit, condition ``BarrierAtRisk``
is True, with the estimate, the window, what an abrupt loss would then cost and what would
fit, and a Warning Event ``BarrierAtRisk`` says so once; when it fits again, with room to
spare (a smaller share of the window: an estimate at the edge does not flip it on every cut),
the condition turns False with an Event ``BarrierFits``.

With ``spec.checkpoint.barrier`` ``auto`` a barrier that a full cut would not fit cuts a delta
(the owners and the rows since the newest full cut, no weights), and with ``delta`` it always
does: then the risk is that even a delta does not fit. A delta's estimate is the fixed part of
the recent cuts (with a trainer group, a step's seconds among it); its bytes, a few megabytes,
count for nothing beside it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from spotrl_operator.signals import PROVIDER_CLOUDS
from spotrl_operator.world import Builder
from spotrl_runtime.api.rljob import CutEstimateStatus
from spotrl_runtime.core.cut_estimate import Assessment, CutEstimate, assess

CONDITION = "BarrierAtRisk"


def shortest_window(
    deadline_seconds: int, caps: Mapping[str, int], clouds: frozenset[str] | None = None
) -> tuple[int, str]:
    """The shortest barrier deadline the job may get, and whose it is. ``clouds``: those the
    cluster's nodes run on; a cloud's own provider (GKE's, AKS's) counts only where its cloud
    is among them (None: not known, every cap counts)."""
    window, source = deadline_seconds, "spec.checkpoint.barrierDeadlineSeconds"
    for provider, cap in sorted(caps.items(), key=lambda kv: (kv[1], kv[0])):
        cloud = PROVIDER_CLOUDS.get(provider)
        if clouds is not None and cloud is not None and cloud not in clouds:
            continue
        if cap < window:
            window, source = cap, f"signals.deadlineCaps {provider}={cap}"
    return window, source


def _estimate(e: CutEstimateStatus) -> CutEstimate:
    return CutEstimate(
        seconds=e.seconds,
        bytes=e.bytes,
        bytes_per_second=e.bytes_per_second,
        overhead_seconds=e.overhead_seconds,
        based_on_cuts=e.based_on_cuts,
        step_seconds=e.step_seconds,
    )


def assess_job(b: Builder) -> Assessment | None:
    """The assessment of the job's published estimate (None: no estimate yet), with the
    stricter bar of a job already at risk."""
    if b.st.cut_estimate is None:
        return None
    ckpt = b.world.spec.checkpoint
    window, source = shortest_window(ckpt.barrier_deadline_seconds, b.world.deadline_caps, b.world.clouds)
    full = _estimate(b.st.cut_estimate)

    def judge(est: CutEstimate) -> Assessment:
        return assess(
            est,
            window,
            every_steps=ckpt.every_steps,
            every_seconds=ckpt.every_seconds,
            delta_every_steps=ckpt.delta_every_steps,
            window_source=source,
            was_at_risk=b.has_condition(CONDITION),
        )

    if ckpt.barrier == "full":
        return judge(full)
    if ckpt.barrier == "auto":
        first = judge(full)
        if not first.at_risk:
            return first
    delta = judge(replace(full, seconds=full.overhead_seconds, bytes=0))
    why = (
        "checkpoint.barrier is delta"
        if ckpt.barrier == "delta"
        else f"a full barrier cut ({full.seconds:.1f} s) would not fit, so checkpoint.barrier auto cuts a delta"
    )
    return replace(delta, message=f"{why}: {delta.message.replace('a barrier cut is', 'a delta cut is', 1)}")


def tend_barrier_risk(b: Builder) -> None:
    """Sets ``BarrierAtRisk`` from the estimate; an Event on each change of its value."""
    if b.st.phase in ("Succeeded", "Failed"):
        return
    was = b.has_condition(CONDITION)
    a = assess_job(b)
    if a is None:
        return
    if a.at_risk:
        if not was:
            b.event("Warning", "BarrierAtRisk", a.message)
        b.condition(CONDITION, True, "CutTooSlow", a.message)
    else:
        if was:
            b.event("Normal", "BarrierFits", a.message)
        b.condition(CONDITION, False, "BarrierFits", a.message)
