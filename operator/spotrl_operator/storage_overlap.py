"""Two RLJobs on one storage: which one waits (pure: no I/O).

A job's *effective storage* is where its cuts go: ``spec.checkpoint.storage``, else the
operator's default root plus ``<namespace>/<name>``, on ``spec.checkpoint.s3Endpoint`` (else
the operator's default endpoint). Two jobs whose storages are the same, or one inside the
other, would read and write one store; the controller refuses a store of another job before it
writes anything (:mod:`spotrl_runtime.checkpoint.ownership`: ``JOB.json`` at each store's
root), but the operator sees it first, from the RLJobs alone, and holds a job back (the
condition ``StorageConflict`` naming the other job, and no controller pod, until one of them
moves or goes). Which job is held, of two whose storages overlap (the newer: by creation time,
then namespace and name):

- *the same store*: the newer job waits, whatever their namespaces;
- *one store strictly inside the other*, both jobs in one namespace: the newer job waits;
- *one store strictly inside the other*, the jobs in two namespaces: only the job whose storage
  *encloses* the other's can be held, and only when it is the newer one. A storage that is too
  wide (a bucket's root, a prefix over other jobs' stores) is its own owner's problem, never
  another tenant's: an older job in namespace A on ``s3://bucket`` holds no job of namespace B
  on ``s3://bucket/b/run``, which starts (its controller still refuses a store that is really
  another job's), while a newer job of B on ``s3://bucket`` waits for A's job inside it.

A finished job (phase Succeeded or Failed) writes no more cuts: it holds no job back.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlparse


@dataclass(frozen=True)
class JobStorage:
    """One RLJob's effective storage, and what orders it among jobs."""

    namespace: str
    name: str
    created: str
    """metadata.creationTimestamp (RFC 3339, so string order is time order)."""
    storage: str
    endpoint: str = ""
    """The S3 endpoint ("": the default, AWS's)."""
    finished: bool = False
    """The job is over (status.phase Succeeded or Failed): it holds no other job back."""
    uid: str = ""
    """The RLJob's metadata.uid: which cache entry this is (:mod:`~spotrl_operator.relist`)."""

    @property
    def age_key(self) -> tuple[str, str, str]:
        return (self.created, self.namespace, self.name)

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


def _place(uri: str, endpoint: str) -> tuple[str, tuple[str, ...]]:
    """Where a storage URI points: (the store it is on, its path segments)."""
    if uri.startswith("s3://"):
        parsed = urlparse(uri)
        return f"s3 {endpoint.rstrip('/')} {parsed.netloc}", tuple(s for s in parsed.path.split("/") if s)
    path = urlparse(uri).path if uri.startswith("file://") else uri
    norm = posixpath.normpath(path)
    return "file" + (" /" if norm.startswith("/") else ""), tuple(s for s in norm.split("/") if s and s != ".")


def overlaps(a: JobStorage, b: JobStorage) -> bool:
    """Whether the two storages are one, or one lies inside the other."""
    (store_a, path_a), (store_b, path_b) = _place(a.storage, a.endpoint), _place(b.storage, b.endpoint)
    if store_a != store_b:
        return False
    n = min(len(path_a), len(path_b))
    return path_a[:n] == path_b[:n]


def _holds(older: JobStorage, newer: JobStorage) -> bool:
    """Whether ``older`` holds ``newer`` back (the rules of the module's docstring)."""
    if older.finished or not overlaps(older, newer):
        return False
    if older.namespace == newer.namespace:
        return True
    # Across namespaces: the same store holds the newer job; a store strictly inside another
    # holds only a newer job whose storage encloses it.
    return len(_place(newer.storage, newer.endpoint)[1]) <= len(_place(older.storage, older.endpoint)[1])


def conflict(me: JobStorage, jobs: Iterable[JobStorage]) -> str | None:
    """Why ``me`` must wait (None: it need not): the oldest other job, older than ``me`` and not
    finished, that holds it back (see the module's docstring)."""
    elders = sorted(
        (j for j in jobs if (j.namespace, j.name) != (me.namespace, me.name) and j.age_key < me.age_key),
        key=lambda j: j.age_key,
    )
    other = next((j for j in elders if _holds(j, me)), None)
    if other is None:
        return None
    mine, theirs = _place(me.storage, me.endpoint), _place(other.storage, other.endpoint)
    how = "is also" if mine == theirs else ("encloses" if len(mine[1]) < len(theirs[1]) else "overlaps")
    return (
        f"the checkpoint storage {me.storage} {how} the storage of RLJob {other} "
        f"({other.storage}), created before this one; "
        "two jobs on one store would refuse each other's cuts: give this job its own spec.checkpoint.storage "
        f"(or delete {other}); no controller starts until then"
    )
