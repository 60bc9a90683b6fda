"""The one storage interface every cut, dataset and tool goes through.

A store is a flat key space (``a/b/c``) like S3. Two backends implement it:
:class:`~spotrl_runtime.storage.local.LocalStorage` (a folder, the embedded default) and
:class:`~spotrl_runtime.storage.s3.S3Storage` (any S3-compatible server). Keys are always
``/``-separated and relative to the store's root; callers never see backend paths.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO, Protocol, runtime_checkable

CHUNK = 8 * 1024 * 1024


class StorageError(Exception):
    """A storage operation failed; the message names the key and the store."""


class ObjectNotFoundError(StorageError):
    """The key does not exist."""


class ObjectExistsError(StorageError):
    """A create-only put found the key already there: someone else wrote it first."""


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


def sha256_file(path: Path) -> tuple[int, str]:
    """Size and sha256 hex digest of a local file."""
    with open(path, "rb") as f:
        return sha256_stream(f)
