"""The durable audit trail: one object per trained step per attempt, next to the cuts.

Cuts carry only the tail of the audit log. So that the whole run stays machine-checkable
across any number of preemptions, the controller appends each step's
:class:`~spotrl_runtime.core.audit.AuditRecord` here right after ``commit_step``:
``audit/<step>.<attempt>.json``, create-only. Steps trained again after an abrupt loss
get a record of the new attempt beside the old one; the effective stream is the last
attempt's record per step.
"""

from __future__ import annotations

import json

from spotrl_runtime.checkpoint.layout import AUDIT
from spotrl_runtime.core.audit import AuditRecord, effective_stream
from spotrl_runtime.storage import Storage


class AuditTrail:
    """Append and read a job's audit records in its store."""

    def __init__(self, storage: Storage):
        self.storage = storage

    @staticmethod
    def key(step: int, attempt: int) -> str:
        """Where the record of ``step`` trained by ``attempt`` lives (key order = step order)."""
        return f"{AUDIT}/{step:010d}.{attempt:04d}.json"

    def append(self, record: AuditRecord) -> None:
        """Stores one record; a step is committed once per attempt, so the write is create-only."""
        data = json.dumps(record.to_json(), sort_keys=True).encode("utf-8")
        self.storage.put_bytes(self.key(record.step, record.attempt), data, create_only=True)

    def records(self) -> list[AuditRecord]:
        """Every record, by step then attempt."""
        return [
            AuditRecord.from_json(json.loads(self.storage.get_bytes(o.key))) for o in self.storage.list(f"{AUDIT}/")
        ]

    def effective_stream(self) -> dict[int, AuditRecord]:
        """The last attempt's record of every step."""
        return effective_stream(self.records())
