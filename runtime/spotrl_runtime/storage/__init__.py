"""Storage behind one small interface: a local folder or an S3-compatible server.

Use :func:`open_storage` with a path, ``file://`` URI or ``s3://bucket/prefix``.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse

from spotrl_runtime.storage.base import (
    ObjectExistsError,
    ObjectInfo,
    ObjectNotFoundError,
    Storage,
    StorageDeadlineError,
    StorageError,
    current_deadline,
    deadline_scope,
    download_prefix,
    join_key,
    sha256_file,
    sha256_stream,
)
from spotrl_runtime.storage.local import LocalStorage

__all__ = [
    "LocalStorage",
    "ObjectExistsError",
    "ObjectInfo",
    "ObjectNotFoundError",
    "Storage",
    "StorageDeadlineError",
    "StorageError",
    "current_deadline",
    "deadline_scope",
    "download_prefix",
    "join_key",
    "open_object",
    "open_storage",
    "sha256_file",
    "sha256_stream",
]


def open_storage(
    uri: str,
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    access_key: str | None = None,
    secret_key: str | None = None,
    credentials_dir: str | Path | None = None,
) -> Storage:
    """The store rooted at ``uri``: a path, ``file:///path`` or ``s3://bucket/prefix``.

    S3 settings not given here come from the environment (``AWS_ENDPOINT_URL``,
    ``AWS_REGION``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``).
    """
    if uri.startswith("s3://"):
        from spotrl_runtime.storage.s3 import S3Storage

        parsed = urlparse(uri)
        if not parsed.netloc:
            raise StorageError(f"{uri!r} names no bucket: use s3://bucket/prefix")
        return S3Storage(
            parsed.netloc,
            parsed.path.strip("/"),
            endpoint_url=endpoint_url,
            region=region,
            access_key=access_key,
            secret_key=secret_key,
            credentials_dir=credentials_dir,
        )
    if uri.startswith("file://"):
        return LocalStorage(Path(unquote(urlparse(uri).path)))
    if "://" in uri:
        raise StorageError(f"unsupported storage URI {uri!r}: use a path, file:///path or s3://bucket/prefix")
    return LocalStorage(Path(uri))


def open_object(uri: str, **s3_options: str | None) -> tuple[Storage, str]:
    """The store holding one object and the object's key, e.g. for ``s3://b/data/train.jsonl``."""
    if uri.startswith("s3://"):
        parsed = urlparse(uri)
        head, _, name = parsed.path.strip("/").rpartition("/")
        if not name:
            raise StorageError(f"{uri!r} names no object")
        return open_storage(f"s3://{parsed.netloc}/{head}", **s3_options), name
    path = Path(unquote(urlparse(uri).path)) if uri.startswith("file://") else Path(uri)
    return LocalStorage(path.absolute().parent), path.name
