"""The S3 server the storage tests use behaves like S3 where SpotRL depends on it."""

import pytest
from botocore.exceptions import ClientError

from spotrl_e2e.s3 import S3Bucket

pytestmark = pytest.mark.s3


def test_put_get_list_delete(s3_bucket: S3Bucket) -> None:
    s3 = s3_bucket.client()
    s3.put_object(Bucket=s3_bucket.bucket, Key="cuts/0001/manifest.json", Body=b'{"step": 1}')
    assert s3.get_object(Bucket=s3_bucket.bucket, Key="cuts/0001/manifest.json")["Body"].read() == b'{"step": 1}'
    listed = s3.list_objects_v2(Bucket=s3_bucket.bucket, Prefix="cuts/")
    assert [o["Key"] for o in listed["Contents"]] == ["cuts/0001/manifest.json"]
    s3.delete_object(Bucket=s3_bucket.bucket, Key="cuts/0001/manifest.json")
    assert s3.list_objects_v2(Bucket=s3_bucket.bucket).get("KeyCount") == 0


def test_conditional_put_if_none_match_fails_the_second_time(s3_bucket: S3Bucket) -> None:
    """A cut's commit marker is written with If-None-Match: * so two writers cannot both commit."""
    s3 = s3_bucket.client()
    s3.put_object(Bucket=s3_bucket.bucket, Key="COMMITTED", Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as err:
        s3.put_object(Bucket=s3_bucket.bucket, Key="COMMITTED", Body=b"second", IfNoneMatch="*")
    assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert err.value.response["Error"]["Code"] == "PreconditionFailed"
    assert s3.get_object(Bucket=s3_bucket.bucket, Key="COMMITTED")["Body"].read() == b"first"


def test_conditional_put_if_match_etag(s3_bucket: S3Bucket) -> None:
    """If-Match with a stale ETag fails with 412; with the current ETag it succeeds."""
    s3 = s3_bucket.client()
    first = s3.put_object(Bucket=s3_bucket.bucket, Key="latest", Body=b"1")["ETag"]
    second = s3.put_object(Bucket=s3_bucket.bucket, Key="latest", Body=b"2", IfMatch=first)["ETag"]
    with pytest.raises(ClientError) as err:
        s3.put_object(Bucket=s3_bucket.bucket, Key="latest", Body=b"3", IfMatch=first)
    assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert s3.head_object(Bucket=s3_bucket.bucket, Key="latest")["ETag"] == second


def test_buckets_are_fresh_per_test(s3_bucket: S3Bucket) -> None:
    assert s3_bucket.client().list_objects_v2(Bucket=s3_bucket.bucket).get("KeyCount") == 0
    assert s3_bucket.endpoint.startswith("http://127.0.0.1:")
