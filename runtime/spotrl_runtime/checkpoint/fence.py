"""The fence: one controller at a time writes a job's audit and cuts.

Every controller claims its attempt number before it restores anything, with a create-only
put of ``attempts/<attempt>.json`` in the job's store, naming its job. From then on any
controller of that job with a lower attempt is *fenced*: before each audit record and before
each cut's manifest it looks for a higher claim of its job, and on finding one it stops with
:class:`FencedError`, writing nothing more. A claim that exists already means two
controllers were given one attempt number; the second one never starts.

A claim of another job fences nobody: a job pointed at this store by mistake is refused
before it claims anything (:mod:`~spotrl_runtime.checkpoint.ownership`), and a claim forged
or left by another job is ignored. A claim that names no job (written before claims named
one) counts as the store's own job's.

In a cluster the operator numbers attempts (``status.attempt``); locally the attempt is one
past every attempt that left a trace (:func:`~spotrl_runtime.checkpoint.resume.resume_or_start`),
claims included, so two ``spotrl run`` on one store never both train.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import socket

from spotrl_runtime.core.identity import JobIdentity
from spotrl_runtime.storage import ObjectExistsError, ObjectNotFoundError, Storage

log = logging.getLogger("spotrl.fence")

ATTEMPTS = "attempts"


class FencedError(RuntimeError):
    """A newer controller owns the job (or this attempt was claimed twice): stop, write nothing."""


def claim_key(attempt: int) -> str:
    """The key that claims ``attempt``."""
    return f"{ATTEMPTS}/{attempt:010d}.json"


def claimed_attempts(storage: Storage) -> list[int]:
    """Every attempt claimed in the store (by any job), ascending."""
    out = []
    for info in storage.list(f"{ATTEMPTS}/"):
        name = info.key.rsplit("/", 1)[-1]
        if name.endswith(".json") and name[:-5].isdigit():
            out.append(int(name[:-5]))
    return sorted(out)


def claim_owner(storage: Storage, key: str) -> JobIdentity | None:
    """The job a claim names; None for a claim that names none (an older format), or that is
    gone or unreadable (it cannot be told from such a claim)."""
    try:
        doc = json.loads(storage.get_bytes(key))
    except (ObjectNotFoundError, ValueError):
        return None
    return JobIdentity.from_json(doc.get("job")) if isinstance(doc, dict) else None


class Fence:
    """This controller's claim on its job."""

    def __init__(self, storage: Storage, attempt: int, job: JobIdentity | None = None):
        """``job``: whose claims count (None: every claim, as before claims named a job)."""
        self.storage = storage
        self.attempt = attempt
        self.job = job
        self._foreign: set[str] = set()
        """Keys of newer claims found to be another job's: read once, ignored from then on."""

    def claim(self) -> Fence:
        """Claims the attempt; :class:`FencedError` if it is claimed already or a newer one is."""
        doc = {
            "attempt": self.attempt,
            "job": self.job.to_json() if self.job is not None else None,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "claimed_at": dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds"),
        }
        key = claim_key(self.attempt)
        try:
            self.storage.put_bytes(key, json.dumps(doc).encode(), create_only=True)
        except ObjectExistsError:
            other = claim_owner(self.storage, key)
            whose = f" by job {str(other)!r}" if other is not None and not self._counts(other) else ""
            raise FencedError(
                f"controller attempt {self.attempt} of {self.storage.uri} is claimed already{whose} "
                f"({key}): another controller runs as this attempt; this one does not start"
            ) from None
        self.check()
        return self

    def check(self) -> None:
        """Raises :class:`FencedError` if a newer attempt of this job has claimed it. Listing
        keys is the whole cost while nobody newer claims; a newer claim is read once."""
        for attempt in reversed(claimed_attempts(self.storage)):
            if attempt <= self.attempt:
                break
            key = claim_key(attempt)
            if key in self._foreign:
                continue
            other = claim_owner(self.storage, key) if self.job is not None else None
            if other is None or self._counts(other):
                raise FencedError(
                    f"fenced: controller attempt {attempt} claimed {self.storage.uri} after this one "
                    f"(attempt {self.attempt}); this one stops and writes nothing more"
                )
            self._foreign.add(key)
            log.warning("ignoring %s in %s: a claim of job %s, not %s", key, self.storage.uri, other, self.job)

    def _counts(self, other: JobIdentity) -> bool:
        return self.job is None or self.job.same_job(other)
