"""The one storage interface every cut, dataset and tool goes through.

A store is a flat key space (``a/b/c``) like S3. Two backends implement it:
:class:`~spotrl_runtime.storage.local.LocalStorage` (a folder, the embedded default) and
:class:`~spotrl_runtime.storage.s3.S3Storage` (any S3-compatible server). Keys are always
``/``-separated and relative to the store's root; callers never see backend paths.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO, Protocol, runtime_checkable

from spotrl_runtime.api.times import Deadline, rfc3339

CHUNK = 8 * 1024 * 1024


class StorageError(Exception):
    """A storage operation failed; the message names the key and the store.

    ``in_doubt`` is true for a write that failed but may have taken effect anyway, or may
    still take effect: a request reached the server (or may have) and no definite answer
    came back (a lost answer, a reset after sending, an attempt abandoned at a deadline).
    ``code`` is the backend's error code when it gave one (``SlowDown``, ``NoSuchKey`` ...).
    """

    def __init__(self, message: str = "", *, in_doubt: bool = False, code: str = ""):
        super().__init__(message)
        self.in_doubt = in_doubt
        self.code = code


class StorageDeadlineError(StorageError):
    """The deadline in scope (:func:`deadline_scope`) passed before the operation finished."""


class ObjectNotFoundError(StorageError):
    """The key does not exist."""


class ObjectExistsError(StorageError):
    """A create-only put found the key already there: someone else wrote it first."""


_DEADLINE: ContextVar[Deadline | None] = ContextVar("spotrl_storage_deadline", default=None)


@contextmanager
def deadline_scope(deadline: Deadline | None, *, replace: bool = False) -> Iterator[None]:
    """Bounds every storage call made in this block (in this thread and in the transfer
    threads it starts) by ``deadline``: no attempt starts after it, no retry sleeps past it,
    and an attempt still running when it passes is abandoned (:class:`StorageDeadlineError`).

    Scopes nest: the earlier deadline wins, unless ``replace`` (then ``deadline`` holds, and
    None lifts the bound). A ``None`` deadline without ``replace`` changes nothing.
    """
    current = _DEADLINE.get()
    chosen = deadline
    if not replace and (deadline is None or (current is not None and current.at <= deadline.at)):
        chosen = current
    token = _DEADLINE.set(chosen)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def current_deadline() -> Deadline | None:
    """The deadline in scope, or None."""
    return _DEADLINE.get()


def describe_deadline(deadline: Deadline) -> str:
    """``2025-01-01T00:00:00Z, 1.2 s ago`` (or ``in 3.0 s``), for messages."""
    left = deadline.remaining()
    when = rfc3339(time.time() + left)
    return f"{when}, {-left:.1f} s ago" if left <= 0 else f"{when}, in {left:.1f} s"


def check_deadline(action: str, where: str) -> float | None:
    """Seconds left before the deadline in scope (None: no deadline); raises
    :class:`StorageDeadlineError` naming ``action`` and ``where`` once it has passed."""
    deadline = _DEADLINE.get()
    if deadline is None:
        return None
    left = deadline.remaining()
    if left <= 0:
        raise StorageDeadlineError(f"{action} {where} not started: the deadline ({describe_deadline(deadline)}) passed")
    return left


@dataclass(frozen=True)
class ObjectInfo:
    """What a head or a list tells about one object."""

    key: str
    size: int


@runtime_checkable
class Storage(Protocol):
    """put/get/head/list/delete over keys, with create-only puts and streamed reads.

    ``create_only=True`` makes a put fail with :class:`ObjectExistsError` when the key exists,
    atomically: of two concurrent create-only puts of one key exactly one wins. Every put
    is all-or-nothing: a reader sees the old object (or none) or the whole new one.
    """

    uri: str
    """Where the store's root is, for messages (``s3://bucket/prefix`` or ``file:///path``)."""

    def put_bytes(self, key: str, data: bytes, *, create_only: bool = False) -> ObjectInfo:
        """Writes ``data`` to ``key``."""
        ...

    def put_file(self, key: str, path: Path, *, create_only: bool = False) -> ObjectInfo:
        """Writes a local file to ``key``; large files go in parallel parts where the backend can."""
        ...

    def open_write(self, key: str, *, create_only: bool = False) -> AbstractContextManager[IO[bytes]]:
        """A stream to write ``key`` through, for objects produced piece by piece (a serialised
        state_dict). The object appears, whole, when the ``with`` block ends without error;
        on error nothing appears. Large streams go up in parallel parts as they are written."""
        ...

    def get_bytes(self, key: str) -> bytes:
        """Reads a whole object. Raises :class:`ObjectNotFoundError`."""
        ...

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Reads ``length`` bytes from ``start`` (fewer at the end of the object)."""
        ...

    def open_read(self, key: str) -> BinaryIO:
        """A streamed reader of the object, for files too big to hold in memory."""
        ...

    def download_file(self, key: str, path: Path) -> ObjectInfo:
        """Copies an object to a local file (parallel ranged reads where the backend can)."""
        ...

    def head(self, key: str) -> ObjectInfo | None:
        """Size of the object, or None if it does not exist."""
        ...

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``, in key order."""
        ...

    def delete(self, key: str) -> None:
        """Removes the key; removing a missing key is not an error."""
        ...


def join_key(*parts: str) -> str:
    """Joins key parts with single slashes, ignoring empty parts."""
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


def sha256_stream(reader: BinaryIO) -> tuple[int, str]:
    """Size and sha256 hex digest of everything ``reader`` yields."""
    h = hashlib.sha256()
    size = 0
    while chunk := reader.read(CHUNK):
        h.update(chunk)
        size += len(chunk)
    return size, h.hexdigest()


def download_prefix(store: Storage, dest: Path) -> int:
    """Copies every object of ``store`` into the local folder ``dest`` (keys become relative
    paths). Returns how many."""
    count = 0
    for info in store.list(""):
        target = dest.joinpath(*info.key.split("/"))
        target.parent.mkdir(parents=True, exist_ok=True)
        store.download_file(info.key, target)
        count += 1
    return count


def sha256_file(path: Path) -> tuple[int, str]:
    """Size and sha256 hex digest of a local file."""
    with open(path, "rb") as f:
        return sha256_stream(f)
