"""Who a job is, as its store and its fence claims record it (pure: no I/O).

Two jobs are the same job when their names are equal and, where both know one, their
namespaces are. The uid is kept for the record, not compared: an RLJob deleted with
``retentionPolicy: Retain`` and created again under its name resumes its cuts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class JobIdentity:
    """Who a job is: its name, and in a cluster its namespace and uid."""

    name: str
    namespace: str | None = None
    uid: str | None = None

    @classmethod
    def of(cls, metadata: Mapping[str, Any]) -> JobIdentity:
        """The identity in an RLJob's ``metadata`` (a local file may name no namespace and has no uid)."""
        return cls(
            name=str(metadata.get("name") or ""),
            namespace=str(metadata["namespace"]) if metadata.get("namespace") else None,
            uid=str(metadata["uid"]) if metadata.get("uid") else None,
        )

    @classmethod
    def from_json(cls, doc: Any) -> JobIdentity | None:
        """The identity a stored document names, or None when it names none (an older format)."""
        if not isinstance(doc, Mapping) or not isinstance(doc.get("name"), str) or not doc["name"]:
            return None
        ns, uid = doc.get("namespace"), doc.get("uid")
        return cls(
            doc["name"], ns if isinstance(ns, str) and ns else None, uid if isinstance(uid, str) and uid else None
        )

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "namespace": self.namespace, "uid": self.uid}

    def same_job(self, other: JobIdentity) -> bool:
        """Equal names, and equal namespaces where both name one."""
        if self.name != other.name:
            return False
        return self.namespace is None or other.namespace is None or self.namespace == other.namespace

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}" if self.namespace else self.name
