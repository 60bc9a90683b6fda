"""The fence: one controller at a time writes a job's audit and cuts.

Every controller claims its attempt number before it restores anything, with a create-only
put of ``attempts/<attempt>.json`` in the job's store. From then on any controller with a
lower attempt is *fenced*: before each audit record and before each cut's manifest it looks
for a higher claim, and on finding one it stops with :class:`FencedError`, writing nothing
more. A claim that exists already means two controllers were given one attempt number; the
second one never starts.

In a cluster the operator numbers attempts (``status.attempt``); locally the attempt is one
past every attempt that left a trace (:func:`~spotrl_runtime.checkpoint.resume.resume_or_start`),
claims included, so two ``spotrl run`` on one store never both train.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket

from spotrl_runtime.storage import ObjectExistsError, Storage

ATTEMPTS = "attempts"


class FencedError(RuntimeError):
    """A newer controller owns the job (or this attempt was claimed twice): stop, write nothing."""


def claim_key(attempt: int) -> str:
    """The key that claims ``attempt``."""
    return f"{ATTEMPTS}/{attempt:010d}.json"


def claimed_attempts(storage: Storage) -> list[int]:
    """Every attempt claimed in the store, ascending."""
    out = []
    for info in storage.list(f"{ATTEMPTS}/"):
        name = info.key.rsplit("/", 1)[-1]
        if name.endswith(".json") and name[:-5].isdigit():
            out.append(int(name[:-5]))
    return sorted(out)


class Fence:
    """This controller's claim on the job."""

    def __init__(self, storage: Storage, attempt: int):
        self.storage = storage
        self.attempt = attempt

    def claim(self) -> Fence:
        """Claims the attempt; :class:`FencedError` if it is claimed already or a newer one is."""
        doc = {
            "attempt": self.attempt,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "claimed_at": dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds"),
        }
        try:
            self.storage.put_bytes(claim_key(self.attempt), json.dumps(doc).encode(), create_only=True)
        except ObjectExistsError:
            raise FencedError(
                f"controller attempt {self.attempt} of {self.storage.uri} is claimed already "
                f"({claim_key(self.attempt)}): another controller runs as this attempt; this one does not start"
            ) from None
        self.check()
        return self

    def check(self) -> None:
        """Raises :class:`FencedError` if a newer attempt has claimed the job."""
        newer = [a for a in claimed_attempts(self.storage) if a > self.attempt]
        if newer:
            raise FencedError(
                f"fenced: controller attempt {newer[-1]} claimed {self.storage.uri} after this one "
                f"(attempt {self.attempt}); this one stops and writes nothing more"
            )
