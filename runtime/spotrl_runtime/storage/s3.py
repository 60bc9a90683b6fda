"""Any S3-compatible server as a store (AWS, MinIO, Ceph, R2, versitygw ...), through boto3.

- Endpoint and region come from the arguments or the environment (``AWS_ENDPOINT_URL``,
  ``AWS_REGION``/``AWS_DEFAULT_REGION``); addressing is path-style so custom endpoints
  work without wildcard DNS.
- Credentials come from the arguments, a mounted Secret folder (files
  ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY``) or boto3's usual chain (the
  environment first). They are never logged and never appear in ``repr``.
- Every request goes through one retry loop (:meth:`S3Storage._call`): throttling
  (``SlowDown``, 429, 503), other 5xx answers, connection errors, timeouts, and errors while
  a response body streams (a reset in the middle of a download) are retried, up to
  ``max_attempts`` attempts in all, with exponential backoff and jitter. A read retry
  re-reads the whole object or range, so a retried read never mixes bytes of two attempts.
  ``retries`` counts the retries (``retried`` by cause).
- A deadline in scope (:func:`~spotrl_runtime.storage.base.deadline_scope`, a barrier cut's)
  bounds every call, in this thread and in the part threads: no attempt starts after it, no
  backoff sleeps past it, and an attempt still running when it passes is abandoned (it runs
  on a helper thread and the caller stops waiting for it): :class:`StorageDeadlineError`.
- A failed write whose request may have reached the server is marked ``in_doubt`` (see
  :class:`~spotrl_runtime.storage.base.StorageError`).
- Files above ``multipart_threshold`` go up as a multipart upload with parts sent in
  parallel; big downloads use parallel ranged GETs.
- A create-only put sends ``If-None-Match: *`` (on the single PUT, or on
  CompleteMultipartUpload); the server refuses it with 412 if the key exists. A 412 met by a
  retry, after an attempt that may have landed, is checked: the key holding our bytes is our
  own write (success), different bytes are a conflict (:class:`ObjectExistsError`), and a
  key that cannot be read back is neither (``in_doubt`` :class:`StorageError`).
- A server that ignores ``If-None-Match: *`` turns every create-only put into an overwrite, and
  with it the fence and the manifest's commit: :func:`probe_create_only` finds that out before
  a controller writes anything that counts (check ``create_only``).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import io
import os
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, BinaryIO, TypeVar, cast

from spotrl_runtime.storage.base import (
    ObjectExistsError,
    ObjectInfo,
    ObjectNotFoundError,
    StorageDeadlineError,
    StorageError,
    current_deadline,
    describe_deadline,
    join_key,
)

T = TypeVar("T")
CHUNK = 8 * 1024 * 1024

PROBES = "_probe"
"""Prefix of the keys :func:`probe_create_only` writes (and deletes) under a store's root."""

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
        backoff_base: float = 0.25,
        backoff_max: float = 20.0,
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
        self.max_attempts = max(1, max_attempts)
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.retries = 0
        """Retries made so far (attempts after the first of each call)."""
        self.retried: Counter[str] = Counter()
        """Retries by cause: the error code or exception name that caused each."""
        if credentials_dir is not None and access_key is None:
            access_key, secret_key = read_credentials_dir(credentials_dir)
        region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        config = Config(
            region_name=region,
            s3={"addressing_style": "path"},
            # One attempt per botocore call: the retries are ours (_call), so that they also
            # cover a response body that breaks while it streams, and honour deadlines.
            retries={"mode": "standard", "total_max_attempts": 1},
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
        self._stats_lock = threading.Lock()
        self._random = random.Random()

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

    def _submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Runs ``fn`` on a part thread in a copy of the caller's context (its deadline)."""
        return self._executor().submit(contextvars.copy_context().run, fn, *args)

    def _map(self, fn: Callable[[Any], T], items: Any) -> list[T]:
        futures = [self._submit(fn, item) for item in items]
        try:
            return [f.result() for f in futures]
        finally:
            for f in futures:
                f.cancel()

    def close(self) -> None:
        """Stops the part-upload threads."""
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def _error(self, err: Exception, key: str, action: str) -> StorageError:
        code = _code(err)
        if code in ("NoSuchKey", "404", "NotFound"):
            return ObjectNotFoundError(f"{self.uri}/{key} does not exist", code=code)
        if code in ("PreconditionFailed", "412"):
            return ObjectExistsError(f"{self.uri}/{key} already exists (create-only write refused)", code=code)
        if code == "NoSuchBucket":
            return StorageError(
                f"{action} {self.uri}/{key}: bucket {self.bucket!r} does not exist; create it first", code=code
            )
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"):
            return StorageError(
                f"{action} {self.uri}/{key}: access denied ({code}); check the credentials and the bucket policy",
                code=code,
            )
        return StorageError(f"{action} {self.uri}/{key} failed: {code or type(err).__name__}: {err}", code=code)

    # ------------------------------------------------------------------ retries

    def _call(self, action: str, key: str, attempt_fn: Callable[[], T]) -> T:
        """Runs one request (``attempt_fn``: the botocore call and the reading of its body)
        with retries and backoff, bounded by the deadline in scope; raises a
        :class:`StorageError` naming ``action`` and ``key``, ``in_doubt`` when an attempt
        may have reached the server without a definite answer."""
        deadline = current_deadline()
        in_doubt = False
        attempt = 0
        while True:
            attempt += 1
            if deadline is not None and deadline.remaining() <= 0:
                done = "not started" if attempt == 1 else f"not done after {attempt - 1} attempts"
                raise StorageDeadlineError(
                    f"{action} {self.uri}/{key} {done}: the deadline ({describe_deadline(deadline)}) passed",
                    in_doubt=in_doubt,
                )
            t0 = time.monotonic()
            try:
                return attempt_fn() if deadline is None else _bounded(attempt_fn, deadline.remaining())
            except _AbandonedError:
                assert deadline is not None
                raise StorageDeadlineError(
                    f"{action} {self.uri}/{key} did not finish before the deadline ({describe_deadline(deadline)}): "
                    f"attempt {attempt} was abandoned after {time.monotonic() - t0:.1f} s without an answer",
                    in_doubt=True,
                ) from None
            except Exception as err:
                retry, doubtful = _classify(err)
                in_doubt = in_doubt or doubtful
                if not retry or attempt >= self.max_attempts:
                    mapped = self._error(err, key, action)
                    mapped.in_doubt = in_doubt
                    if retry:
                        mapped.args = (f"{mapped} (gave up after {attempt} attempts)",)
                    raise mapped from None
                cap = min(self.backoff_max, self.backoff_base * 2 ** (attempt - 1))
                delay = cap / 2 + self._random.random() * cap / 2
                if deadline is not None and deadline.remaining() <= delay:
                    raise StorageDeadlineError(
                        f"{action} {self.uri}/{key} failed ({_code(err) or type(err).__name__}: {err}) and the "
                        f"deadline ({describe_deadline(deadline)}) leaves no time for attempt {attempt + 1}",
                        in_doubt=in_doubt,
                    ) from None
                with self._stats_lock:
                    self.retries += 1
                    self.retried[_code(err) or type(err).__name__] += 1
                time.sleep(delay)

    # ------------------------------------------------------------------ writes

    def put_bytes(self, key: str, data: bytes, *, create_only: bool = False) -> ObjectInfo:
        full = self._key(key)
        extra = {"IfNoneMatch": "*"} if create_only else {}
        try:
            self._call("put", key, lambda: self._client.put_object(Bucket=self.bucket, Key=full, Body=data, **extra))
        except ObjectExistsError as err:
            # A retry of a PUT whose answer was lost meets our own object and gets 412.
            if err.in_doubt:
                self._check_ours(key, lambda: self.get_bytes(key) == data)
                return ObjectInfo(key, len(data))
            raise
        return ObjectInfo(key, len(data))

    def _check_ours(self, key: str, ours: Callable[[], bool]) -> None:
        """After a 412 that an earlier attempt of ours may have caused: returns if the key
        holds our bytes, raises :class:`ObjectExistsError` if it holds others, and an
        ``in_doubt`` :class:`StorageError` if it cannot be read back."""
        try:
            mine = ours()
        except StorageError as err:
            raise StorageError(
                f"create-only put of {self.uri}/{key}: an earlier attempt may have landed, and the key exists but "
                f"could not be read back to tell whether it holds our bytes: {err}",
                in_doubt=True,
            ) from None
        if not mine:
            raise ObjectExistsError(f"{self.uri}/{key} already exists (create-only write refused)")

    def put_file(self, key: str, path: Path, *, create_only: bool = False) -> ObjectInfo:
        size = os.path.getsize(path)
        if size < self.multipart_threshold:
            return self.put_bytes(key, Path(path).read_bytes(), create_only=create_only)
        return self._put_multipart(key, Path(path), size, create_only)

    def _start_multipart(self, key: str) -> str:
        full = self._key(key)
        return cast(
            str,
            self._call(
                "start multipart upload of",
                key,
                lambda: self._client.create_multipart_upload(Bucket=self.bucket, Key=full)["UploadId"],
            ),
        )

    def _upload_part(self, key: str, upload_id: str, number: int, body: bytes | bytearray) -> dict[str, Any]:
        full = self._key(key)
        etag = self._call(
            f"upload part {number} of",
            key,
            lambda: self._client.upload_part(
                Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumber=number, Body=body
            )["ETag"],
        )
        return {"ETag": etag, "PartNumber": number}

    def _complete_multipart(self, key: str, upload_id: str, parts: list[dict[str, Any]], create_only: bool) -> None:
        full = self._key(key)
        extra = {"IfNoneMatch": "*"} if create_only else {}
        try:
            self._call(
                "complete multipart upload of",
                key,
                lambda: self._client.complete_multipart_upload(
                    Bucket=self.bucket, Key=full, UploadId=upload_id, MultipartUpload={"Parts": parts}, **extra
                ),
            )
        except StorageError as err:
            # An earlier attempt that completed the upload makes a retry fail with
            # NoSuchUpload (or 412): the object's multipart ETag tells whether it is ours.
            if err.in_doubt and (isinstance(err, ObjectExistsError) or err.code == "NoSuchUpload"):
                self._check_ours(key, lambda: self._etag(key) == _multipart_etag(parts))
                return
            raise

    def _etag(self, key: str) -> str:
        full = self._key(key)
        return cast(
            str, self._call("head", key, lambda: self._client.head_object(Bucket=self.bucket, Key=full)["ETag"])
        ).strip('"')

    def _abort_multipart(self, key: str, upload_id: str) -> None:
        # If the abort fails too, the bucket's lifecycle rule reaps the abandoned upload.
        full = self._key(key)
        with contextlib.suppress(Exception):
            self._call(
                "abort multipart upload of",
                key,
                lambda: self._client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id),
            )

    def _put_multipart(self, key: str, path: Path, size: int, create_only: bool) -> ObjectInfo:
        # Parts must number at most 10,000; grow the part size for very large files.
        part_size = max(self.part_size, -(-size // 10_000))
        upload_id = self._start_multipart(key)

        def send(number: int) -> dict[str, Any]:
            offset = (number - 1) * part_size
            length = min(part_size, size - offset)
            with open(path, "rb") as f:
                body = os.pread(f.fileno(), length, offset)
            return self._upload_part(key, upload_id, number, body)

        count = -(-size // part_size)
        try:
            parts = self._map(send, range(1, count + 1))
            self._complete_multipart(key, upload_id, parts, create_only)
        except BaseException as err:
            self._abort_multipart(key, upload_id)
            if isinstance(err, StorageError):
                raise
            raise StorageError(f"multipart upload of {self.uri}/{key} failed: {type(err).__name__}: {err}") from err
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
        full = self._key(key)
        return self._call(
            "get", key, lambda: cast(bytes, self._client.get_object(Bucket=self.bucket, Key=full)["Body"].read())
        )

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        full = self._key(key)
        try:
            return self._call(
                "get",
                key,
                lambda: cast(
                    bytes,
                    self._client.get_object(Bucket=self.bucket, Key=full, Range=f"bytes={start}-{start + length - 1}")[
                        "Body"
                    ].read(),
                ),
            )
        except StorageError as err:
            if err.code in ("InvalidRange", "416"):
                return b""
            raise

    def open_read(self, key: str) -> BinaryIO:
        """A streamed reader; a read that breaks resumes with a ranged GET from where it was
        (pinned to the object's ETag), within the retry budget of each read."""
        reader = _ResumingReader(self, key)
        reader.open_at(0)
        return cast(BinaryIO, io.BufferedReader(reader, 1 * MiB))

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
                want = min(self.part_size, size - offset)
                data = self.get_range(key, offset, want)
                if len(data) != want:
                    raise StorageError(f"get {self.uri}/{key}: range at {offset} gave {len(data)} of {want} bytes")
                os.pwrite(fd, data, offset)

            self._map(fetch, range(0, size, self.part_size))
        return ObjectInfo(key, size)

    def head(self, key: str) -> ObjectInfo | None:
        full = self._key(key)
        try:
            resp = self._call("head", key, lambda: self._client.head_object(Bucket=self.bucket, Key=full))
        except ObjectNotFoundError:
            return None
        return ObjectInfo(key, int(resp["ContentLength"]))

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        full = join_key(self.prefix, prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        if prefix.endswith("/") and not full.endswith("/"):
            full += "/"
        strip = len(self.prefix) + 1 if self.prefix else 0
        token: str | None = None
        while True:
            page = self._call("list", prefix, self._lister(full, token))
            for obj in page.get("Contents", []):
                yield ObjectInfo(obj["Key"][strip:], int(obj["Size"]))
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                return

    def _lister(self, full: str, token: str | None) -> Callable[[], dict[str, Any]]:
        extra = {"ContinuationToken": token} if token else {}
        return lambda: cast(dict[str, Any], self._client.list_objects_v2(Bucket=self.bucket, Prefix=full, **extra))

    def delete(self, key: str) -> None:
        full = self._key(key)
        with contextlib.suppress(ObjectNotFoundError):
            self._call("delete", key, lambda: self._client.delete_object(Bucket=self.bucket, Key=full))


class CreateOnlyIgnoredError(StorageError):
    """The store took a second create-only put of one key: it ignores ``If-None-Match: *``."""

    check = "create_only"


def probe_create_only(store: S3Storage) -> None:
    """Puts a fresh probe key create-only twice, with different bytes, and raises
    :class:`CreateOnlyIgnoredError` if the second put succeeds: the fence's claims and every
    cut's manifest rely on the store refusing it (412), or two controllers could both commit.
    The key is deleted afterwards where the store lets it be. A probe that cannot finish raises
    the store's own :class:`StorageError`: it proves nothing either way."""
    key = f"{PROBES}/create-only-{uuid.uuid4().hex}"
    try:
        store.put_bytes(key, b"first", create_only=True)
        try:
            # Other bytes than the first put's: a retried 412 is not mistaken for our own write.
            store.put_bytes(key, b"second", create_only=True)
        except ObjectExistsError:
            return
    finally:
        with contextlib.suppress(StorageError):
            store.delete(key)
    raise CreateOnlyIgnoredError(
        f"create_only: the S3 store at {store.endpoint_url or 'AWS'} (bucket {store.bucket!r}) accepted a second "
        f"create-only put of {store.uri}/{key}; it ignores If-None-Match: *, so two controllers could both commit a "
        "cut; use a store that supports conditional writes (AWS S3 since 2024, MinIO, versitygw ...)"
    )


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
        if self.upload_id is None:
            self.upload_id = self.storage._start_multipart(self.key)
        while len(self.pending) >= self.storage.parallelism:
            self.parts.append(self.pending.pop(0).result())
        number = len(self.parts) + len(self.pending) + 1
        # ``chunk`` is never touched again: the stream starts a new buffer after each part.
        self.pending.append(self.storage._submit(self.storage._upload_part, self.key, self.upload_id, number, chunk))

    def finish(self) -> None:
        """Completes the object (raises :class:`ObjectExistsError` for a refused create-only write)."""
        if not self.multipart:
            self.storage.put_bytes(self.key, bytes(self.buf), create_only=self.create_only)
            return
        if self.buf:
            self._send(self.buf)
            self.buf = bytearray()
        assert self.upload_id is not None
        try:
            self.parts.extend(f.result() for f in self.pending)
            self.pending = []
            self.storage._complete_multipart(self.key, self.upload_id, self.parts, self.create_only)
        except BaseException as err:
            self.abort()
            if isinstance(err, StorageError):
                raise
            raise StorageError(
                f"multipart upload of {self.storage.uri}/{self.key} failed: {type(err).__name__}: {err}"
            ) from err
        self.upload_id = None

    def abort(self) -> None:
        """Gives up: nothing appears under the key."""
        for f in self.pending:
            f.cancel()
        if self.upload_id is not None:
            self.storage._abort_multipart(self.key, self.upload_id)
            self.upload_id = None


class _ResumingReader(io.RawIOBase):
    """A read-only stream over an object that reopens a broken body with a ranged GET at its
    offset, pinned to the object's ETag (``If-Match``), so a resumed read never mixes two
    versions of the object."""

    def __init__(self, storage: S3Storage, key: str):
        super().__init__()
        self.storage = storage
        self.key = key
        self.full = storage._key(key)
        self.offset = 0
        self.etag: str | None = None
        self.body: Any = None

    def readable(self) -> bool:
        return True

    def open_at(self, offset: int) -> None:
        def attempt() -> Any:
            extra: dict[str, str] = {"Range": f"bytes={offset}-"} if offset else {}
            if self.etag is not None:
                extra["IfMatch"] = self.etag
            return self.storage._client.get_object(Bucket=self.storage.bucket, Key=self.full, **extra)

        try:
            resp = self.storage._call("get", self.key, attempt)
        except StorageError as err:
            if err.code in ("InvalidRange", "416"):
                self.body = io.BytesIO(b"")
                return
            raise
        self.etag = self.etag or resp.get("ETag")
        self.body = resp["Body"]

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")

        def attempt() -> bytes:
            if self.body is None:
                self.open_at(self.offset)
            try:
                return cast(bytes, self.body.read(len(view)))
            except Exception:
                with contextlib.suppress(Exception):
                    self.body.close()
                self.body = None
                raise

        data = self.storage._call("get", self.key, attempt)
        view[: len(data)] = data
        self.offset += len(data)
        return len(data)

    def readall(self) -> bytes:
        out = bytearray()
        buf = bytearray(CHUNK)
        while n := self.readinto(buf):
            out += buf[:n]
        return bytes(out)

    def close(self) -> None:
        if self.body is not None:
            with contextlib.suppress(Exception):
                self.body.close()
            self.body = None
        super().close()


class _AbandonedError(Exception):
    """An attempt still running when the deadline passed."""


def _bounded(fn: Callable[[], T], seconds: float) -> T:
    """``fn()``, run on a helper thread and waited for at most ``seconds``: a stalled request
    is abandoned (:class:`_AbandonedError`); its thread ends when the socket times out or the
    connection drops. Daemon threads, so an abandoned attempt never holds the process up."""
    box: Future[T] = Future()

    def run() -> None:
        if not box.set_running_or_notify_cancel():
            return
        try:
            box.set_result(fn())
        except BaseException as err:
            box.set_exception(err)

    threading.Thread(target=run, name="s3-attempt", daemon=True).start()
    wait([box], timeout=max(0.0, seconds))
    if not box.done():
        box.cancel()
        raise _AbandonedError
    return box.result()


_THROTTLED = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "ThrottledException",
    "RequestThrottled",
    "RequestThrottledException",
    "TooManyRequests",
    "TooManyRequestsException",
    "RequestLimitExceeded",
    "BandwidthLimitExceeded",
    "ServiceUnavailable",
    "503",
    "429",
}
_TRANSIENT = {
    "RequestTimeout",
    "RequestTimeoutException",
    "PriorRequestNotComplete",
    "InternalError",
    "500",
    "502",
    "504",
}


def _classify(err: Exception) -> tuple[bool, bool]:
    """(retry it, the request may have taken effect) for one failed attempt."""
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import (
        ConnectTimeoutError,
        EndpointConnectionError,
        HTTPClientError,
        IncompleteReadError,
    )
    from urllib3.exceptions import HTTPError as Urllib3Error

    response = getattr(err, "response", None)
    if isinstance(response, dict):
        code = _code(err)
        status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        if code in _THROTTLED or status in (429, 503):
            return True, False  # refused before it was acted on
        if code in _TRANSIENT or status >= 500:
            return True, True  # the server may have acted on it
        return False, False  # a definite answer (4xx)
    if isinstance(err, EndpointConnectionError | ConnectTimeoutError):
        return True, False  # never connected
    if isinstance(
        err, BotoConnectionError | HTTPClientError | IncompleteReadError | Urllib3Error | ConnectionError | TimeoutError
    ):
        return True, True  # reset, timeout or broken stream: sent, answer unknown
    return False, True


def _multipart_etag(parts: list[dict[str, Any]]) -> str:
    """The ETag S3 gives a completed multipart object: md5 of the parts' md5s, ``-`` count."""
    digests = b"".join(bytes.fromhex(str(p["ETag"]).strip('"')) for p in parts)
    return f"{hashlib.md5(digests, usedforsecurity=False).hexdigest()}-{len(parts)}"


def _code(err: Exception) -> str:
    response = getattr(err, "response", None)
    if isinstance(response, dict):
        error = response.get("Error", {}).get("Code", "")
        return str(error or response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return ""
