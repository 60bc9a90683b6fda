"""Exactly-once, counted: what a whole run trained, lost, trained twice and did again, pure.

Computed from two kinds of records in the job's storage, never estimated:

- the audit (:mod:`spotrl_runtime.core.audit`): one record per trained step per attempt, and
  its effective stream (the last record of each step);
- the restore records (:class:`RestoreRecord`, ``recovery/attempt-K.json``): what each attempt
  that resumed from a cut found in it, from the restore's counters.

Prompts are counted by ``group_id``, unique within a run (a group keeps its id across a
restore; a prompt seen again in a later epoch gets a new one). A prompt is *lost* when an
attempt trained it in a step that a later attempt trained again without it, and no step of
the effective stream trained, dropped or filtered it. *Trained twice* counts the extra appearances of a
group id in the effective stream. Both must be 0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from spotrl_runtime.core.audit import FILTERED, AuditRecord, effective_stream
from spotrl_runtime.core.fields import RecordFormatError

SECONDS_KEPT = 64
"""secondsLostPerPreemption keeps the newest this many."""


@dataclass(frozen=True)
class RestoreRecord:
    """What one attempt found in the cut it resumed from, and when (Unix seconds)."""

    attempt: int
    cut_id: str
    cut_step: int
    cut_committed_at: float | None = None
    groups_redispatched: int = 0
    """Unfinished ledger groups in the cut, all dispatched again (ADMITTED at once, RESERVED
    through the gate)."""
    siblings_reused: int = 0
    """Finished sibling rollouts of restored ADMITTED groups kept, not generated again."""
    turns_restored: int = 0
    """Finished turns of unfinished episodes in the cut (multi-turn jobs): they resume, not
    generated again, unless their environment does not replay."""
    finished_found: int = 0
    """Finished groups (replay buffer) in the cut: they train without generation."""
    started_at: float | None = None
    restored_at: float | None = None
    ready_at: float | None = None
    cut_form: str = "full"
    """What the cut held: ``full`` (the weights), or ``delta`` (rows since a full cut, redone)."""
    steps_redone: int = 0
    """A delta's steps trained again from their rows while restoring (not counted as trained twice)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> RestoreRecord:
        if not isinstance(data, dict):
            raise RecordFormatError("restore record is not a JSON object")
        try:
            return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
        except TypeError as err:
            raise RecordFormatError(f"restore record: {err}") from None


@dataclass
class RunAccounting:
    """The run's exactly-once numbers (the RLJob's ``status.accounting``, in snake_case)."""

    prompts_trained: int = 0
    prompts_dropped: int = 0
    prompts_filtered: int = 0
    """Prompts a filter refused at admission, each with its reason (e.g. ``prompt_too_long``)."""
    prompts_lost: int = 0
    prompts_trained_twice: int = 0
    steps_missing: int = 0
    steps_retrained: int = 0
    groups_redispatched: int = 0
    siblings_reused: int = 0
    turns_restored: int = 0
    restores: int = 0
    steps_redone: int = 0
    """Steps of delta cuts trained again from their rows while restoring (no new prompts: the
    audit holds each once, so they are not ``steps_retrained``)."""
    seconds_lost_per_preemption: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(docs: Iterable[Mapping[str, Any]], restores: Iterable[RestoreRecord] = ()) -> RunAccounting:
    """The accounting of a run from its audit documents (as stored: the record's fields, plus
    ``at``, the Unix time the step was trained, where the writer kept it) and restore records."""
    docs = list(docs)
    records = [AuditRecord.from_json(dict(d)) for d in docs]
    chosen = effective_stream(records)
    out = RunAccounting()

    trained = Counter(g for r in chosen.values() for g in r.group_ids)
    dropped = {d.group_id for r in chosen.values() for d in r.dropped}
    out.prompts_trained = sum(len(r.group_ids) for r in chosen.values())
    left = [d for r in chosen.values() for d in r.dropped]
    out.prompts_filtered = sum(d.state == FILTERED for d in left)
    out.prompts_dropped = len(left) - out.prompts_filtered
    out.prompts_trained_twice = sum(n - 1 for n in trained.values() if n > 1)
    kept = {(r.step, r.attempt) for r in chosen.values()}
    superseded = {g for r in records if (r.step, r.attempt) not in kept for g in r.group_ids}
    out.prompts_lost = len(superseded - trained.keys() - dropped)
    if chosen:
        out.steps_missing = max(chosen) + 1 - len(chosen)
    out.steps_retrained = len(records) - len({r.step for r in records})

    # The first step each attempt trained, for the seconds lost.
    first_step_at: dict[int, float] = {}
    for d in docs:
        at = d.get("at")
        if isinstance(at, int | float):
            attempt = int(d["attempt"])
            first_step_at[attempt] = min(first_step_at.get(attempt, at), at)
    seconds: list[float] = []
    for rec in sorted(restores, key=lambda r: r.attempt):
        out.restores += 1
        out.groups_redispatched += rec.groups_redispatched
        out.siblings_reused += rec.siblings_reused
        out.turns_restored += rec.turns_restored
        out.steps_redone += rec.steps_redone
        first = first_step_at.get(rec.attempt)
        if first is not None and rec.cut_committed_at is not None:
            seconds.append(round(max(0.0, first - rec.cut_committed_at), 3))
    out.seconds_lost_per_preemption = seconds[-SECONDS_KEPT:]
    return out


@dataclass
class RolloutGap:
    """The generator's mismatch with the trainer over a run's effective stream: each step's
    ``rollout_probs_diff_mean`` weighted by its compared tokens, and the largest
    ``rollout_probs_diff_max`` (``training/rows.py``: ``step_metrics``)."""

    steps: int = 0
    tokens: int = 0
    mean: float = 0.0
    max: float = 0.0


def rollout_gap(docs: Iterable[Mapping[str, Any]]) -> RolloutGap:
    """:class:`RolloutGap` of the steps of the effective stream that measured it (audit
    documents as stored: the record's fields and the step's metrics beside them)."""
    docs = list(docs)
    chosen = effective_stream([AuditRecord.from_json(dict(d)) for d in docs])
    kept = {(r.step, r.attempt) for r in chosen.values()}
    gap, weighted = RolloutGap(), 0.0
    for d in docs:
        tokens = d.get("rollout_probs_diff_tokens")
        if (int(d["step"]), int(d["attempt"])) not in kept or not isinstance(tokens, int | float) or tokens <= 0:
            continue
        gap.steps += 1
        gap.tokens += int(tokens)
        weighted += float(d["rollout_probs_diff_mean"]) * tokens
        gap.max = max(gap.max, float(d["rollout_probs_diff_max"]))
    gap.mean = weighted / gap.tokens if gap.tokens else 0.0
    return gap


def format_summary(acc: RunAccounting, gap: RolloutGap | None = None) -> str:
    """``spotrl audit --summary``: one line per number, as on ``status.accounting``."""
    names = {
        "prompts_trained": "promptsTrained",
        "prompts_dropped": "promptsDropped",
        "prompts_filtered": "promptsFiltered",
        "prompts_lost": "promptsLost",
        "prompts_trained_twice": "promptsTrainedTwice",
        "steps_missing": "stepsMissing",
        "steps_retrained": "stepsRetrained",
        "groups_redispatched": "groupsRedispatched",
        "siblings_reused": "siblingsReused",
        "turns_restored": "turnsRestored",
        "restores": "restores",
        "steps_redone": "stepsRedone",
    }
    width = len("secondsLostPerPreemption") + 2
    lines = [f"{label:<{width}}{getattr(acc, key)}" for key, label in names.items()]
    per = acc.seconds_lost_per_preemption
    lines.append(f"{'secondsLostPerPreemption':<{width}}{', '.join(f'{s:.1f}' for s in per) or '-'}")
    if gap is not None and gap.steps:
        lines.append(f"{'rolloutProbsDiffMean':<{width}}{gap.mean:.3g} ({gap.steps} steps, {gap.tokens} tokens)")
        lines.append(f"{'rolloutProbsDiffMax':<{width}}{gap.max:.3g}")
    return "\n".join(lines)
