"""A folder as a store: the embedded default, and what tests and `spotrl run` use.

Writes are atomic: the bytes go to a hidden temporary file in the target folder, are
fsynced, and then appear under their key in one step. A create-only put appears with
``link(2)``, which fails if the key exists, so two writers can never both succeed and a
reader never sees a half-written object. Plain puts appear with ``rename(2)``.

A deadline in scope (:func:`~spotrl_runtime.storage.base.deadline_scope`) is checked before
each operation (and before a streamed write commits); local calls are not interrupted.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, BinaryIO

from spotrl_runtime.storage.base import (
    ObjectExistsError,
    ObjectInfo,
    ObjectNotFoundError,
    StorageError,
    check_deadline,
)

_TMP_PREFIX = ".tmp-"


class LocalStorage:
    """The store rooted at a local folder (created on first write)."""

    def __init__(self, root: Path | str):
        self.root = Path(root).absolute()
        self.uri = self.root.as_uri()

    def __repr__(self) -> str:
        return f"LocalStorage({str(self.root)!r})"

    def path_of(self, key: str) -> Path:
        """The local file that holds ``key`` (readers use it to avoid a copy)."""
        return self._path(key)

    def _check(self, action: str, key: str) -> None:
        check_deadline(action, f"{self.uri}/{key}")

    def _path(self, key: str) -> Path:
        parts = key.split("/")
        if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise StorageError(f"invalid key {key!r} for {self.uri}: use relative a/b/c keys without '.' or '..'")
        return self.root.joinpath(*parts)

    # ------------------------------------------------------------------ writes

    def _commit(self, tmp: Path, final: Path, key: str, create_only: bool) -> None:
        try:
            if create_only:
                try:
                    os.link(tmp, final)  # fails if the key exists: atomic create-only
                except FileExistsError:
                    raise ObjectExistsError(f"{self.uri}/{key} already exists (create-only write refused)") from None
            else:
                os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(final.parent)

    def _tmp_for(self, final: Path) -> Path:
        final.parent.mkdir(parents=True, exist_ok=True)
        return final.parent / f"{_TMP_PREFIX}{final.name}.{uuid.uuid4().hex[:12]}"

    def put_bytes(self, key: str, data: bytes, *, create_only: bool = False) -> ObjectInfo:
        self._check("put", key)
        final = self._path(key)
        if create_only and final.exists():
            raise ObjectExistsError(f"{self.uri}/{key} already exists (create-only write refused)")
        tmp = self._tmp_for(final)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self._commit(tmp, final, key, create_only)
        return ObjectInfo(key, len(data))

    def put_file(self, key: str, path: Path, *, create_only: bool = False) -> ObjectInfo:
        self._check("put", key)
        final = self._path(key)
        if create_only and final.exists():
            raise ObjectExistsError(f"{self.uri}/{key} already exists (create-only write refused)")
        tmp = self._tmp_for(final)
        with open(path, "rb") as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 16 * 1024 * 1024)
            dst.flush()
            os.fsync(dst.fileno())
            size = dst.tell()
        self._commit(tmp, final, key, create_only)
        return ObjectInfo(key, size)

    @contextmanager
    def open_write(self, key: str, *, create_only: bool = False) -> Iterator[IO[bytes]]:
        self._check("put", key)
        final = self._path(key)
        if create_only and final.exists():
            raise ObjectExistsError(f"{self.uri}/{key} already exists (create-only write refused)")
        tmp = self._tmp_for(final)
        try:
            with open(tmp, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            self._check("put", key)
            self._commit(tmp, final, key, create_only)
        finally:
            tmp.unlink(missing_ok=True)

    # ------------------------------------------------------------------- reads

    def get_bytes(self, key: str) -> bytes:
        self._check("get", key)
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFoundError(f"{self.uri}/{key} does not exist") from None

    def get_range(self, key: str, start: int, length: int) -> bytes:
        self._check("get", key)
        with self.open_read(key) as f:
            f.seek(start)
            return f.read(length)

    def open_read(self, key: str) -> BinaryIO:
        self._check("get", key)
        try:
            return open(self._path(key), "rb")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFoundError(f"{self.uri}/{key} does not exist") from None

    def download_file(self, key: str, path: Path) -> ObjectInfo:
        self._check("get", key)
        with self.open_read(key) as src, open(path, "wb") as dst:
            shutil.copyfileobj(src, dst, 16 * 1024 * 1024)
            return ObjectInfo(key, dst.tell())

    def head(self, key: str) -> ObjectInfo | None:
        self._check("head", key)
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not os.path.isfile(self._path(key)):
            return None
        return ObjectInfo(key, st.st_size)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        self._check("list", prefix)
        if not self.root.is_dir():
            return
        # Walk only the folder the prefix names, then filter by the rest of the prefix.
        head, _, _ = prefix.rpartition("/")
        start = self.root.joinpath(*head.split("/")) if head else self.root
        if not start.is_dir():
            return
        found: list[ObjectInfo] = []
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames[:] = [d for d in dirnames if not d.startswith(_TMP_PREFIX)]
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                if name.startswith(_TMP_PREFIX):
                    continue
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix):
                    try:
                        found.append(ObjectInfo(key, os.stat(os.path.join(dirpath, name)).st_size))
                    except FileNotFoundError:
                        continue  # deleted while we walked
        yield from sorted(found, key=lambda o: o.key)

    def delete(self, key: str) -> None:
        self._check("delete", key)
        path = self._path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        # Remove folders left empty so a deleted cut leaves no trace.
        parent = path.parent
        while parent != self.root:
            try:
                parent.rmdir()
            except OSError as err:
                if err.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                    break
                raise
            parent = parent.parent


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
