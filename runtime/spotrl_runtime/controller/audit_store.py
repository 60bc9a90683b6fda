"""The run's audit in storage: one small object per trained step per attempt.

``audit/step-00000012/attempt-0003.json`` says which prompts step 12 trained on when the
third controller trained it. A step trained again after an abrupt loss gets a record of
the later attempt; the effective stream keeps the last one per step. Objects, not an
appended log, because S3 has no append and a controller may die between any two writes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from spotrl_runtime.core.accounting import RestoreRecord, RunAccounting, summarize
from spotrl_runtime.core.audit import AuditRecord, effective_stream
from spotrl_runtime.storage import Storage

PREFIX = "audit/"
STEP_PREFIX = f"{PREFIX}step-"
EPISODES_PREFIX = f"{PREFIX}episodes/"
"""``audit/episodes/step-00000012/attempt-0003.json``: a few episodes of step 12 as attempt 3
trained them, turn by turn (jobs with ``spec.environment``; ``spotrl episodes`` prints them)."""
RESTORE_PREFIX = f"{PREFIX}restores/"
"""``audit/restores/attempt-0003.json``: what attempt 3 found in the cut it resumed from (its
restore counters) and when it started, restored and was ready. Under ``audit/``, so the job's
retention deletes it with the rest."""


def record_key(record: AuditRecord) -> str:
    return f"{PREFIX}step-{record.step:08d}/attempt-{record.attempt:04d}.json"


class AuditStore:
    """Writes and reads the audit records of one job's storage root."""

    def __init__(self, storage: Storage):
        self.storage = storage
        self.listeners: list[Callable[[dict[str, Any]], object]] = []
        """Called with each document once it is stored (e.g. to keep ``status.accounting``)."""

    def write(self, record: AuditRecord, **extra: Any) -> None:
        """Stores one trained step. ``extra`` (reward, seconds ...) is kept beside the record, and
        ``at``, when it was written (Unix seconds: the run's accounting reads each attempt's first
        step from it)."""
        doc = {**record.to_json(), "at": round(time.time(), 3), **extra}
        self.storage.put_bytes(record_key(record), json.dumps(doc, sort_keys=True).encode())
        for listener in self.listeners:
            listener(doc)

    def latest_attempt(self) -> int | None:
        """The highest attempt that trained a step (from the keys alone), or None."""
        attempts = [
            int(o.key.rsplit("attempt-", 1)[1].removesuffix(".json"))
            for o in self.storage.list(STEP_PREFIX)
            if "attempt-" in o.key and o.key.endswith(".json")
        ]
        return max(attempts, default=None)

    def documents(self) -> list[dict[str, Any]]:
        """Every stored record, oldest step and attempt first."""
        keys = sorted(o.key for o in self.storage.list(STEP_PREFIX) if o.key.endswith(".json"))
        return [json.loads(self.storage.get_bytes(k)) for k in keys]

    def write_episodes(self, record: AuditRecord, episodes: list[dict[str, Any]]) -> None:
        """Stores a trained step's transcripts (:func:`~spotrl_runtime.rollouts.transcripts.transcripts`)."""
        key = f"{EPISODES_PREFIX}step-{record.step:08d}/attempt-{record.attempt:04d}.json"
        doc = {"step": record.step, "attempt": record.attempt, "episodes": episodes}
        self.storage.put_bytes(key, json.dumps(doc, sort_keys=True).encode())

    def episodes(self, step: int) -> dict[str, Any] | None:
        """Step ``step``'s transcripts as its last attempt trained it, or None."""
        keys = sorted(o.key for o in self.storage.list(f"{EPISODES_PREFIX}step-{step:08d}/") if o.key.endswith(".json"))
        return json.loads(self.storage.get_bytes(keys[-1])) if keys else None

    def write_restore(self, record: RestoreRecord) -> None:
        """Stores what one resumed attempt found in its cut (one object per attempt)."""
        key = f"{RESTORE_PREFIX}attempt-{record.attempt:04d}.json"
        self.storage.put_bytes(key, json.dumps(record.to_json(), sort_keys=True).encode())

    def restores(self) -> list[RestoreRecord]:
        """Every stored restore record, oldest attempt first."""
        keys = sorted(o.key for o in self.storage.list(RESTORE_PREFIX) if o.key.endswith(".json"))
        return [RestoreRecord.from_json(json.loads(self.storage.get_bytes(k))) for k in keys]

    def accounting(self) -> RunAccounting:
        """The run's exactly-once numbers, from every audit and restore record in storage."""
        return summarize(self.documents(), self.restores())

    def effective(self) -> list[dict[str, Any]]:
        """The last record of each step, in step order: what the run really trained on."""
        docs = self.documents()
        chosen = effective_stream(AuditRecord.from_json(d) for d in docs)
        by_key = {(d["step"], d["attempt"]): d for d in docs}
        return [by_key[(r.step, r.attempt)] for _, r in sorted(chosen.items())]
