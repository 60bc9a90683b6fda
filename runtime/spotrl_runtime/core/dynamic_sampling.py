"""Dynamic sampling (DAPO's): which finished groups carry no learning signal. Pure.

A group whose rollouts all scored the same reward has zero advantage under every estimator,
so it trains nothing while it holds one of the step's places. With
``spec.training.sampling.dynamic`` set, :meth:`~spotrl_runtime.core.owners.Owners.pump`
filters such groups once every group of the step has finished, and fills their places from
the loader, a round at a time, at most ``maxRounds`` rounds (see ``docs/guides/numerics.md``).
"""

from __future__ import annotations

from spotrl_runtime.core.audit import AuditRecord
from spotrl_runtime.core.types import FinishedGroup

ZERO_STD = "zero-std"
"""The reason every group filtered by dynamic sampling carries, first."""


def without_signal(group: FinishedGroup) -> str | None:
    """The reason to filter ``group`` (its rewards are all equal), or None when it has signal."""
    rewards = {r.reward for r in group.rollouts}
    if len(rewards) != 1:
        return None
    return f"{ZERO_STD}: its {len(group.rollouts)} rewards were all {rewards.pop():g} (dynamic sampling)"


def sampling_stats(record: AuditRecord) -> dict[str, float]:
    """A trained step's metrics under dynamic sampling: the groups it filtered for want of
    signal, their share of the step's finished groups, and the refill rounds it took."""
    filtered = sum(d.reason.startswith(ZERO_STD) for d in record.dropped)
    return {
        "dynamic_filtered": float(filtered),
        "dynamic_filtered_share": round(filtered / max(filtered + len(record.group_ids), 1), 6),
        "refill_rounds": float(record.rounds),
    }
