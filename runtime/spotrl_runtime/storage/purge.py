"""What a job owns under its storage root, and the one way to delete it
(``spec.checkpoint.retentionPolicy: Delete``, ``spotrl ckpt delete``).

A job owns the cut folders (``cuts/``), the pointer (``LATEST.json``), the audit log
(``audit/``), the controllers' fence claims (``attempts/``), its TensorBoard event files
(``tensorboard/``), the keys of an S3 create-only probe a controller could not delete
(``_probe/``) and the store's identity file
(``JOB.json``, deleted last: a store half purged is still the job's); other keys under the
same root are not its and stay. The names are spelled out here, not imported from the checkpoint
and controller packages: they import torch, and the operator's image (which runs the deletion) has
none. A unit test keeps them equal.

A deletion only ever happens under the job's own prefix, ``<storage>/<namespace>/<name>``:
with one credentials Secret shared by tenants, a job whose storage names another's root must
not delete it. :func:`job_prefix_problem` is that check, pure, for the operator (which
refuses with an Event) and for ``spotrl ckpt delete`` (which refuses to start).
"""

from __future__ import annotations

from urllib.parse import urlparse

from spotrl_runtime.storage.base import Storage

JOB_PREFIXES = ("cuts/", "audit/", "attempts/", "tensorboard/", "_probe/")
JOB_KEYS = ("LATEST.json",)
OWNER_KEY = "JOB.json"
"""The store's identity file (:mod:`spotrl_runtime.checkpoint.ownership`)."""


def job_prefix_problem(uri: str, namespace: str, name: str) -> str | None:
    """Why ``uri`` is not job ``namespace/name``'s own prefix (None when it is): its path must
    end in ``/<namespace>/<name>``, with no empty, ``.`` or ``..`` segment anywhere."""
    path = urlparse(uri).path if "://" in uri else uri
    if uri.startswith("s3://") and not urlparse(uri).netloc:
        return f"{uri} names no bucket"
    segments = path.strip("/").split("/")
    if any(seg in ("", ".", "..") for seg in segments):
        return f"{uri} has an empty, '.' or '..' path segment"
    if segments[-2:] != [namespace, name]:
        return (
            f"{uri} is not the job's own prefix: retentionPolicy Delete only deletes under <storage>/{namespace}/{name}"
        )
    return None


def job_keys(store: Storage) -> list[str]:
    """Every key the job owns under ``store``'s root, sorted."""
    keys = [info.key for prefix in JOB_PREFIXES for info in store.list(prefix)]
    keys += [k for k in (*JOB_KEYS, OWNER_KEY) if store.head(k) is not None]
    return sorted(keys)


def purge(store: Storage) -> list[str]:
    """Deletes what the job owns under ``store``'s root; returns the keys deleted. The pointer
    goes first, so a restore that races the deletion finds no committed cut rather than a
    pointer to a half-deleted one; the identity file goes last."""
    keys = job_keys(store)
    for key in sorted(keys, key=lambda k: (k == OWNER_KEY, k not in JOB_KEYS)):
        store.delete(key)
    return keys
