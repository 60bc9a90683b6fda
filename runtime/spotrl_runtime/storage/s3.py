"""Any S3-compatible server as a store (AWS, MinIO, Ceph, R2, versitygw ...), through boto3.

- Endpoint and region come from the arguments or the environment (``AWS_ENDPOINT_URL``,
  ``AWS_REGION``/``AWS_DEFAULT_REGION``); addressing is path-style so custom endpoints
  work without wildcard DNS.
- Credentials come from the arguments, a mounted Secret folder (files
  ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY``) or boto3's usual chain (the
  environment first). They are never logged and never appear in ``repr``.
- Throttling (``SlowDown``, 429, 503) and other 5xx answers are retried with exponential
  backoff and jitter by botocore's ``standard`` retry mode.
- Files above ``multipart_threshold`` go up as a multipart upload with parts sent in
  parallel; big downloads use parallel ranged GETs.
- A create-only put sends ``If-None-Match: *`` (on the single PUT, or on
  CompleteMultipartUpload); the server refuses it with 412 if the key exists.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, BinaryIO, cast

from spotrl_runtime.storage.base import ObjectExistsError, ObjectInfo, ObjectNotFoundError, StorageError, join_key

MiB = 1024 * 1024


def read_credentials_dir(path: Path | str) -> tuple[str, str]:
    """Reads AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY from a mounted Secret folder."""
    folder = Path(path)
    try:
        access = (folder / "AWS_ACCESS_KEY_ID").read_text().strip()
        secret = (folder / "AWS_SECRET_ACCESS_KEY").read_text().strip()
    except FileNotFoundError as err:
        raise StorageError(
            f"credentials folder {folder} lacks {Path(err.filename).name}: mount a Secret with the keys "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        ) from None
    if not access or not secret:
        raise StorageError(f"credentials folder {folder} has an empty AWS_ACCESS_KEY_ID or AWS_SECRET_ACCESS_KEY")
    return access, secret


class S3Storage:
    """The store rooted at ``s3://bucket/prefix``."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        credentials_dir: Path | str | None = None,
        max_attempts: int = 8,  # in all, the first try included
        parallelism: int = 8,
        multipart_threshold: int = 64 * MiB,
        part_size: int = 32 * MiB,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
    ):
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        self.parallelism = max(1, parallelism)
        self.multipart_threshold = multipart_threshold
        self.part_size = max(5 * MiB, part_size)
        if credentials_dir is not None and access_key is None:
            access_key, secret_key = read_credentials_dir(credentials_dir)
        region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        config = Config(
            region_name=region,
            s3={"addressing_style": "path"},
            retries={"mode": "standard", "total_max_attempts": max_attempts},
            max_pool_connections=self.parallelism * 2,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            # Only checksum what S3 requires; our own sha256 covers integrity end to end.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        session = boto3.session.Session()
        self._client: Any = session.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            config=config,
        )
        self._pool_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def __repr__(self) -> str:
        return f"S3Storage({self.uri!r}, endpoint={self.endpoint_url!r})"

    @property
    def client(self) -> Any:
        """The boto3 client (for tools and benchmarks that compare with plain boto3)."""
        return self._client

    def _key(self, key: str) -> str:
        if not key or key.startswith("/"):
            raise StorageError(f"invalid key {key!r} for {self.uri}")
        return join_key(self.prefix, key)

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.parallelism, thread_name_prefix="s3-part")
            return self._pool

    def close(self) -> None:
        """Stops the part-upload threads."""
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def _error(self, err: Exception, key: str, action: str) -> StorageError:
        code = _code(err)
        if code in ("NoSuchKey", "404", "NotFound"):
            return ObjectNotFoundError(f"{self.uri}/{key} does not exist")
        if code in ("PreconditionFailed", "412"):
            return ObjectExistsError(f"{self.uri}/{key} already exists (create-only write refused)")
        if code == "NoSuchBucket":
            return StorageError(f"{action} {self.uri}/{key}: bucket {self.bucket!r} does not exist; create it first")
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"):
            return StorageError(
                f"{action} {self.uri}/{key}: access denied ({code}); check the credentials and the bucket policy"
            )
        return StorageError(f"{action} {self.uri}/{key} failed: {code or type(err).__name__}: {err}")

    # ------------------------------------------------------------------ writes

    def put_bytes(self, key: str, data: bytes, *, create_only: bool = False) -> ObjectInfo:
        extra = {"IfNoneMatch": "*"} if create_only else {}
        try:
            self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **extra)
        except Exception as err:
            mapped = self._error(err, key, "put")
            # botocore retries a PUT whose answer was lost; if the first attempt had landed,
            # the retry meets our own object and gets 412. Same bytes there: it was ours.
            if isinstance(mapped, ObjectExistsError) and self._holds(key, data):
                return ObjectInfo(key, len(data))
            raise mapped from None
        return ObjectInfo(key, len(data))

    def _holds(self, key: str, data: bytes) -> bool:
        try:
            return self.get_bytes(key) == data
        except StorageError:
            return False

    def put_file(self, key: str, path: Path, *, create_only: bool = False) -> ObjectInfo:
        size = os.path.getsize(path)
        if size < self.multipart_threshold:
            return self.put_bytes(key, Path(path).read_bytes(), create_only=create_only)
        return self._put_multipart(key, Path(path), size, create_only)

    def _put_multipart(self, key: str, path: Path, size: int, create_only: bool) -> ObjectInfo:
        full = self._key(key)
        # Parts must number at most 10,000; grow the part size for very large files.
        part_size = max(self.part_size, -(-size // 10_000))
        try:
            upload_id = self._client.create_multipart_upload(Bucket=self.bucket, Key=full)["UploadId"]
        except Exception as err:
            raise self._error(err, key, "start multipart upload of") from None

        def send(number: int) -> dict[str, Any]:
            offset = (number - 1) * part_size
            length = min(part_size, size - offset)
            with open(path, "rb") as f:
                body = os.pread(f.fileno(), length, offset)
            etag = self._client.upload_part(
                Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumber=number, Body=body
            )["ETag"]
            return {"ETag": etag, "PartNumber": number}

        count = -(-size // part_size)
        try:
            parts = list(self._executor().map(send, range(1, count + 1)))
            extra = {"IfNoneMatch": "*"} if create_only else {}
            self._client.complete_multipart_upload(
                Bucket=self.bucket, Key=full, UploadId=upload_id, MultipartUpload={"Parts": parts}, **extra
            )
        except Exception as err:
            # If the abort fails too, the bucket's lifecycle rule reaps the abandoned upload.
            with contextlib.suppress(Exception):
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
            raise self._error(err, key, "multipart upload of") from None
        return ObjectInfo(key, size)

    @contextmanager
    def open_write(self, key: str, *, create_only: bool = False) -> Iterator[IO[bytes]]:
        stream = _StreamUpload(self, key, create_only)
        try:
            yield cast(IO[bytes], stream)
            stream.finish()
        except BaseException:
            stream.abort()
            raise

    # ------------------------------------------------------------------- reads

    def get_bytes(self, key: str) -> bytes:
        try:
            body = self._client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
            return cast(bytes, body.read())
        except Exception as err:
            raise self._error(err, key, "get") from None

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        try:
            body = self._client.get_object(
                Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{start + length - 1}"
            )["Body"]
            return cast(bytes, body.read())
        except Exception as err:
            if _code(err) in ("InvalidRange", "416"):
                return b""
            raise self._error(err, key, "get") from None

    def open_read(self, key: str) -> BinaryIO:
        try:
            return cast(BinaryIO, self._client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"])
        except Exception as err:
            raise self._error(err, key, "get") from None

    def download_file(self, key: str, path: Path) -> ObjectInfo:
        info = self.head(key)
        if info is None:
            raise ObjectNotFoundError(f"{self.uri}/{key} does not exist")
        size = info.size
        with open(path, "wb") as f:
            f.truncate(size)
            if size < self.multipart_threshold:
                f.write(self.get_bytes(key))
                return ObjectInfo(key, size)
            fd = f.fileno()

            def fetch(offset: int) -> None:
                data = self.get_range(key, offset, min(self.part_size, size - offset))
                os.pwrite(fd, data, offset)

            list(self._executor().map(fetch, range(0, size, self.part_size)))
        return ObjectInfo(key, size)

    def head(self, key: str) -> ObjectInfo | None:
        try:
            resp = self._client.head_object(Bucket=self.bucket, Key=self._key(key))
        except Exception as err:
            mapped = self._error(err, key, "head")
            if isinstance(mapped, ObjectNotFoundError):
                return None
            raise mapped from None
        return ObjectInfo(key, int(resp["ContentLength"]))

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        full = join_key(self.prefix, prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        if prefix.endswith("/") and not full.endswith("/"):
            full += "/"
        strip = len(self.prefix) + 1 if self.prefix else 0
        paginator = self._client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full):
                for obj in page.get("Contents", []):
                    yield ObjectInfo(obj["Key"][strip:], int(obj["Size"]))
        except Exception as err:
            raise self._error(err, prefix, "list") from None

    def delete(self, key: str) -> None:
        try:
            self._client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except Exception as err:
            mapped = self._error(err, key, "delete")
            if not isinstance(mapped, ObjectNotFoundError):
                raise mapped from None


class _StreamUpload(io.RawIOBase):
    """A write-only stream that uploads itself: one PUT if it stays below the multipart
    threshold, else a multipart upload whose parts go up in parallel while the writer goes
    on. At most ``parallelism`` parts are in flight, so memory stays bounded and a fast
    writer waits for the network (backpressure)."""

    def __init__(self, storage: S3Storage, key: str, create_only: bool):
        super().__init__()
        self.storage = storage
        self.key = key
        self.full = storage._key(key)
        self.create_only = create_only
        self.part_size = storage.part_size
        self.buf = bytearray()
        self.multipart = False
        self.upload_id: str | None = None
        self.pending: list[Future[dict[str, Any]]] = []
        self.parts: list[dict[str, Any]] = []
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        self.size += n
        if not self.multipart:
            if len(self.buf) + n < self.storage.multipart_threshold:
                self.buf += view  # may still go up as one PUT
                return n
            self.multipart = True
            held, self.buf = self.buf, bytearray()
            self._feed(memoryview(held))
        self._feed(view)
        return n

    def _feed(self, view: memoryview) -> None:
        while len(view):
            room = self.part_size - len(self.buf)
            self.buf += view[:room]
            view = view[room:]
            if len(self.buf) == self.part_size:
                self._send(self.buf)
                self.buf = bytearray()

    def _send(self, chunk: bytearray) -> None:
        client = self.storage._client
        if self.upload_id is None:
            try:
                self.upload_id = client.create_multipart_upload(Bucket=self.storage.bucket, Key=self.full)["UploadId"]
            except Exception as err:
                raise self.storage._error(err, self.key, "start multipart upload of") from None
        while len(self.pending) >= self.storage.parallelism:
            self.parts.append(self.pending.pop(0).result())
        number = len(self.parts) + len(self.pending) + 1
        body = chunk  # never touched again: the stream starts a new buffer after each part
        upload_id = self.upload_id

        def send() -> dict[str, Any]:
            etag = client.upload_part(
                Bucket=self.storage.bucket, Key=self.full, UploadId=upload_id, PartNumber=number, Body=body
            )["ETag"]
            return {"ETag": etag, "PartNumber": number}

        self.pending.append(self.storage._executor().submit(send))

    def finish(self) -> None:
        """Completes the object (raises :class:`ObjectExistsError` for a refused create-only write)."""
        if not self.multipart:
            self.storage.put_bytes(self.key, bytes(self.buf), create_only=self.create_only)
            return
        if self.buf:
            self._send(self.buf)
            self.buf = bytearray()
        try:
            self.parts.extend(f.result() for f in self.pending)
            self.pending = []
            extra = {"IfNoneMatch": "*"} if self.create_only else {}
            self.storage._client.complete_multipart_upload(
                Bucket=self.storage.bucket,
                Key=self.full,
                UploadId=self.upload_id,
                MultipartUpload={"Parts": self.parts},
                **extra,
            )
        except Exception as err:
            self.abort()
            raise self.storage._error(err, self.key, "multipart upload of") from None

    def abort(self) -> None:
        """Gives up: nothing appears under the key."""
        for f in self.pending:
            f.cancel()
        if self.upload_id is not None:
            with contextlib.suppress(Exception):
                self.storage._client.abort_multipart_upload(
                    Bucket=self.storage.bucket, Key=self.full, UploadId=self.upload_id
                )
            self.upload_id = None


def _code(err: Exception) -> str:
    response = getattr(err, "response", None)
    if isinstance(response, dict):
        error = response.get("Error", {}).get("Code", "")
        return str(error or response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return ""
