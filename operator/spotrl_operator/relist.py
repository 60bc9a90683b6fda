"""The periodic live list that repairs the operator's watch caches after a watch gap.

A pass reads the job's pods, its PodDisruptionBudget and other objects, every RLJob's storage,
the Nodes (and Kueue's Workloads) from Kopf's watch caches. After a watch restarts from a
resourceVersion the API server no longer has (410 Gone), Kopf lists again, but it drops a cache
entry only on a DELETED event, and a list reports none: an object deleted in the gap stays
cached, and the operator acts on it:

- a Pod: the job waits on a controller that is gone;
- the job's PodDisruptionBudget, or another of its objects: the job believes it exists and
  never makes it again (without its budget, a drain evicts the controller with no barrier);
- an RLJob: a deleted job's storage still holds another job back (``StorageConflict``);
- a Node: still counted in its zone's brake (:mod:`~spotrl_operator.fleet`);
- a Kueue Workload: the job believes it is queued.

So every :data:`RELIST_INTERVALS` reconcile intervals each cached :class:`Kind` is listed once
from the API server, with the label its watch selects, in each watched namespace (one list per
kind and namespace, whatever the number of jobs); an entry the cache held before the list was
sent, whose uid the list lacks, is a *ghost* (:func:`ghosts`). Readers pass over the ghosts
(:func:`without`); the :class:`~spotrl_operator.fleet.Fleet` forgets its ghost nodes. A uid is
never given twice, so a ghost never hides an object made since, under its name or another.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from spotrl_runtime.kube import Kube, KubeError, path

log = logging.getLogger("spotrl.operator")
T = TypeVar("T")

RELIST_INTERVALS = 10
"""Every cached kind is listed live every this many reconcile intervals."""


@dataclass(frozen=True)
class Kind:
    """One kind the operator caches, and how its watch selects it."""

    name: str
    """As the API names it (``Pod``): for the log."""
    resource: tuple[str, ...]
    """Kopf's (group, version, plural), or (version, plural) for the core group."""
    index: str
    """The Kopf index that caches it ("": the :class:`~spotrl_operator.fleet.Fleet`, for Nodes)."""
    selector: str | None = None
    """The label selector of its watch (None: every object of the kind)."""
    namespaced: bool = True

    def url(self, namespace: str | None) -> str:
        return path("/".join(self.resource[:-1]), self.resource[-1], namespace if self.namespaced else None)


def entry_uid(entry: Any) -> str | None:
    """The uid of a cache entry (a trimmed object's ``metadata.uid``; a
    :class:`~spotrl_operator.storage_overlap.JobStorage`'s ``uid``), or of a listed object."""
    uid = (entry.get("metadata") or {}).get("uid") if isinstance(entry, Mapping) else getattr(entry, "uid", None)
    return str(uid) if uid else None


def cached_uids(entries: Iterable[Any]) -> frozenset[str]:
    return frozenset(uid for entry in entries if (uid := entry_uid(entry)))


def ghosts(cached: frozenset[str], live: frozenset[str] | None, before: frozenset[str]) -> frozenset[str]:
    """The uids the cache held before a live list was sent (``cached``) that the list (``live``)
    lacks: gone, though the cache never heard. An object made after the list was sent is not in
    ``cached``, so never a ghost. ``live`` None (the list failed): the ghosts found before
    (``before``) that the cache still holds."""
    return before & cached if live is None else cached - live


def without(entries: Iterable[T], gone: frozenset[str]) -> tuple[T, ...]:
    """The cache entries but the ghosts (``gone``)."""
    return tuple(e for e in entries if entry_uid(e) not in gone)


def live_uids(kube: Kube, kind: Kind, namespaces: Sequence[str]) -> frozenset[str]:
    """The uids of the kind's objects on the API server now: a list (in chunks, each request with
    the client's timeout) per watched namespace (``namespaces``; empty: the whole cluster)."""
    where: Sequence[str | None] = namespaces if kind.namespaced and namespaces else (None,)
    params: dict[str, Any] = {"labelSelector": kind.selector} if kind.selector else {}
    return frozenset(uid for ns in where for item in kube.list_all(kind.url(ns), **params) if (uid := entry_uid(item)))


def find(
    kube: Kube, cached: Mapping[Kind, frozenset[str]], namespaces: Sequence[str], before: frozenset[str]
) -> dict[Kind, frozenset[str]]:
    """Each kind's ghosts: ``cached``, each kind's cached uids, read before this call sends its
    lists; ``before``, the ghosts the last call found (kept for a kind whose list fails)."""
    found = {}
    for kind, uids in cached.items():
        try:
            live: frozenset[str] | None = live_uids(kube, kind, namespaces)
        except KubeError as err:
            log.warning("listing %s to check the cache: %s", kind.resource[-1], err)
            live = None
        found[kind] = ghosts(uids, live, before)
    return found


def told(found: Mapping[Kind, frozenset[str]], before: frozenset[str]) -> str | None:
    """What of ``found`` is new since ``before``, as a log says it ("1 Pod, 1 PodDisruptionBudget");
    None: nothing new."""
    new = [f"{len(uids - before)} {kind.name}" for kind, uids in found.items() if uids - before]
    return ", ".join(new) or None
