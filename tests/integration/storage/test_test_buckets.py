"""The test S3 server's bucket clean-up, which every S3 test's teardown relies on."""

from __future__ import annotations

import threading
from pathlib import Path

import botocore.exceptions
import pytest

from spotrl_e2e.s3 import S3Server

pytestmark = pytest.mark.s3


def _in_flight_upload(server: S3Server, bucket: str) -> Path:
    """What versitygw's posix backend holds while a PUT or a DELETE of ``job/.probes/k`` is under
    way (a controller's create-only probe as its pod is killed): the key's folder, with nothing
    listable in it yet (or any more). The server counts it: the bucket is not empty."""
    folder = server.workdir / "data" / bucket / "job" / ".probes"
    folder.mkdir(parents=True)
    return folder


def test_a_bucket_with_an_upload_in_flight_is_deleted_once_the_upload_ends(s3_server: S3Server) -> None:
    bucket = s3_server.create_bucket()
    bucket.client().put_object(Bucket=bucket.bucket, Key="a/cut", Body=b"1")
    part = _in_flight_upload(s3_server, bucket.bucket)
    ends = threading.Timer(1.5, lambda: (part.rmdir(), part.parent.rmdir()))  # the probe ends a moment later
    ends.start()
    try:
        s3_server.delete_bucket(bucket)
    finally:
        ends.cancel()
    names = [b["Name"] for b in bucket.client().list_buckets()["Buckets"]]
    assert bucket.bucket not in names


def test_a_bucket_whose_upload_never_ends_is_an_error_after_its_tries(s3_server: S3Server) -> None:
    bucket = s3_server.create_bucket()
    part = _in_flight_upload(s3_server, bucket.bucket)
    with pytest.raises(botocore.exceptions.ClientError, match="BucketNotEmpty"):
        s3_server.delete_bucket(bucket, tries=2)
    part.rmdir()
    part.parent.rmdir()
    s3_server.delete_bucket(bucket)
