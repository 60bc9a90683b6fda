"""A real S3-compatible server for tests: versitygw with its posix backend on a temp folder."""

from __future__ import annotations

import contextlib
import secrets
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import botocore.exceptions

from spotrl_e2e.procs import Process, free_port
from spotrl_e2e.tools import Tools, find_tools

if TYPE_CHECKING:
    from spotrl_runtime.storage.s3 import S3Storage


@dataclass(frozen=True)
class S3Bucket:
    """One bucket on the test S3 server and what a client needs to reach it."""

    endpoint: str
    bucket: str
    access_key: str
    secret_key: str
    region: str

    @property
    def uri(self) -> str:
        """``s3://<bucket>``, the form an RLJob's ``checkpoint.storage`` takes."""
        return f"s3://{self.bucket}"

    def client(self) -> Any:
        """A boto3 S3 client for this server (path-style addressing, no retries hiding errors)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
        )

    def storage(self, prefix: str, **options: Any) -> S3Storage:
        """Our :class:`~spotrl_runtime.storage.s3.S3Storage` on ``<bucket>/<prefix>`` of this
        server (``options``: multipart sizes and the like)."""
        from spotrl_runtime.storage.s3 import S3Storage

        return S3Storage(
            self.bucket,
            prefix,
            endpoint_url=self.endpoint,
            region=self.region,
            access_key=self.access_key,
            secret_key=self.secret_key,
            **options,
        )

    def env(self) -> dict[str, str]:
        """Environment variables that point boto3 (in a pod or a subprocess) at this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ENDPOINT_URL_S3": self.endpoint,
        }


class S3Server:
    """versitygw serving ``<workdir>/data`` on a free loopback port with root credentials."""

    def __init__(self, workdir: Path, tools: Tools | None = None, region: str = "us-east-1"):
        self.tools = tools or find_tools()
        self.workdir = workdir
        self.region = region
        self.access_key = "spotrl-" + secrets.token_hex(4)
        self.secret_key = secrets.token_hex(20)
        self.port = 0
        self.process: Process | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, detached: bool = False, timeout: float = 20.0) -> S3Server:
        self.tools.require("versitygw")
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        # Credentials are flags, not env: the server's env is ours and would leak AWS_* from the host.
        argv: list[str | Path] = [
            self.tools.versitygw,
            "--port", f"127.0.0.1:{self.port}",
            "--access", self.access_key,
            "--secret", self.secret_key,
            "--region", self.region,
            "--quiet",
            "posix", data,
        ]  # fmt: skip
        self.process = Process("versitygw", argv, self.workdir).start(detached=detached)
        probe = self._bucket("probe")
        self.process.wait_ready(lambda: probe.client().list_buckets() is not None, timeout, "serving S3")
        return self

    def _bucket(self, name: str) -> S3Bucket:
        return S3Bucket(self.endpoint, name, self.access_key, self.secret_key, self.region)

    def create_bucket(self, prefix: str = "test") -> S3Bucket:
        """A new, empty bucket with a unique name."""
        bucket = self._bucket(f"{prefix}-{uuid.uuid4().hex[:12]}".lower())
        bucket.client().create_bucket(Bucket=bucket.bucket)
        return bucket

    def delete_bucket(self, bucket: S3Bucket, tries: int = 5) -> None:
        """Deletes every object, unfinished multipart upload and the bucket. An upload still in
        flight (a pod's process killed as its test ends) holds the bucket for a moment: the
        server counts its temporary file, so the bucket is emptied again, ``tries`` times."""
        s3 = bucket.client()
        for attempt in range(1, tries + 1):
            with contextlib.suppress(s3.exceptions.NoSuchBucket):
                self._empty(s3, bucket.bucket)
                try:
                    s3.delete_bucket(Bucket=bucket.bucket)
                except botocore.exceptions.ClientError as err:
                    if err.response.get("Error", {}).get("Code") != "BucketNotEmpty" or attempt == tries:
                        raise
                    time.sleep(1.0)
                    continue
            return

    @staticmethod
    def _empty(s3: Any, name: str) -> None:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=name):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                s3.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
        for up in s3.list_multipart_uploads(Bucket=name).get("Uploads", []):
            s3.abort_multipart_upload(Bucket=name, Key=up["Key"], UploadId=up["UploadId"])

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
