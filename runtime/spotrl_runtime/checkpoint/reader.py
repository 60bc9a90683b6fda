"""Reading a cut from a store: the storage side of the validation chain's :class:`CutSource`.

Small files are read once and kept in memory (validation hashes them, then decodes them);
big files are hashed as they stream, and when the store is remote they are downloaded once
into a spool folder so loading the weights afterwards reads the local copy.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

from spotrl_runtime.checkpoint.layout import cut_dir, manifest_key
from spotrl_runtime.storage import LocalStorage, ObjectNotFoundError, Storage, sha256_file

SMALL = 64 * 1024 * 1024


class StorageCutSource:
    """One cut folder of a store, as the validation chain reads it."""

    def __init__(self, storage: Storage, cut_id: str, spool_dir: Path | None = None):
        self.storage = storage
        self.cut_id = cut_id
        self.location = f"{storage.uri}/{cut_dir(cut_id)}"
        self._base = cut_dir(cut_id)
        self._spool_parent = spool_dir
        self._spool: Path | None = None
        self._bytes: dict[str, bytes] = {}
        self._local: dict[str, Path] = {}
        self._sizes: dict[str, int | None] = {}
        self._manifest: bytes | None = None

    def close(self) -> None:
        """Removes downloaded copies."""
        if self._spool is not None:
            shutil.rmtree(self._spool, ignore_errors=True)
            self._spool = None

    def __enter__(self) -> StorageCutSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _key(self, path: str) -> str:
        return f"{self._base}/{path}"

    def read_manifest(self) -> bytes | None:
        """The manifest's bytes (read once: the chain decodes them, an export hashes them)."""
        if self._manifest is None:
            try:
                self._manifest = self.storage.get_bytes(manifest_key(self.cut_id))
            except ObjectNotFoundError:
                return None
        return self._manifest

    def size(self, path: str) -> int | None:
        if path not in self._sizes:
            info = self.storage.head(self._key(path))
            self._sizes[path] = None if info is None else info.size
        return self._sizes[path]

    def digest(self, path: str) -> str:
        size = self.size(path)
        if size is not None and size <= SMALL:
            return hashlib.sha256(self.read(path)).hexdigest()
        return sha256_file(self.local_path(path))[1]

    def read(self, path: str) -> bytes:
        if path not in self._bytes:
            self._bytes[path] = self.storage.get_bytes(self._key(path))
        return self._bytes[path]

    def local_path(self, path: str) -> Path:
        """A local file with the content of ``path`` (the file itself for a local store)."""
        if isinstance(self.storage, LocalStorage):
            return self.storage.path_of(self._key(path))
        if path not in self._local:
            if self._spool is None:
                self._spool = Path(tempfile.mkdtemp(prefix="spotrl-restore-", dir=self._spool_parent))
            target = self._spool / path.replace("/", "__")
            self.storage.download_file(self._key(path), target)
            self._local[path] = target
        return self._local[path]

    def list_dir(self, folder: str) -> list[str]:
        prefix = f"{self._base}/{folder.strip('/')}/"
        return [info.key[len(self._base) + 1 :] for info in self.storage.list(prefix)]
