"""The run's audit in storage: one small object per trained step per attempt.

``audit/step-00000012/attempt-0003.json`` says which prompts step 12 trained on when the
third controller trained it. A step trained again after an abrupt loss gets a record of
the later attempt; the effective stream keeps the last one per step. Objects, not an
appended log, because S3 has no append and a controller may die between any two writes.
"""

from __future__ import annotations

import json
from typing import Any

from spotrl_runtime.core.audit import AuditRecord, effective_stream
from spotrl_runtime.storage import Storage

PREFIX = "audit/"


def record_key(record: AuditRecord) -> str:
    return f"{PREFIX}step-{record.step:08d}/attempt-{record.attempt:04d}.json"


class AuditStore:
    """Writes and reads the audit records of one job's storage root."""

    def __init__(self, storage: Storage):
        self.storage = storage

    def write(self, record: AuditRecord, **extra: Any) -> None:
        """Stores one trained step. ``extra`` (reward, seconds ...) is kept beside the record."""
        doc = {**record.to_json(), **extra}
        self.storage.put_bytes(record_key(record), json.dumps(doc, sort_keys=True).encode())

    def latest_attempt(self) -> int | None:
        """The highest attempt that trained a step (from the keys alone), or None."""
        attempts = [
            int(o.key.rsplit("attempt-", 1)[1].removesuffix(".json"))
            for o in self.storage.list(PREFIX)
            if "attempt-" in o.key and o.key.endswith(".json")
        ]
        return max(attempts, default=None)

    def documents(self) -> list[dict[str, Any]]:
        """Every stored record, oldest step and attempt first."""
        keys = sorted(o.key for o in self.storage.list(PREFIX) if o.key.endswith(".json"))
        return [json.loads(self.storage.get_bytes(k)) for k in keys]

    def effective(self) -> list[dict[str, Any]]:
        """The last record of each step, in step order: what the run really trained on."""
        docs = self.documents()
        chosen = effective_stream(AuditRecord.from_json(d) for d in docs)
        by_key = {(d["step"], d["attempt"]): d for d in docs}
        return [by_key[(r.step, r.attempt)] for _, r in sorted(chosen.items())]
