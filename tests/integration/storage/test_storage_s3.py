"""The S3 store against a real S3 server (versitygw): the storage contract, create-only writes
(If-None-Match), multipart and parallel transfers, retries on throttling and 5xx, and
credentials from a mounted Secret folder."""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from spotrl_e2e.faultproxy import FaultProxy
from spotrl_runtime.storage import ObjectExistsError, ObjectNotFoundError, StorageError, sha256_file
from spotrl_runtime.storage.s3 import S3Storage

pytestmark = pytest.mark.s3
MiB = 1024 * 1024


def store(bucket: Any, prefix: str = "job", **kw: Any) -> S3Storage:
    kw.setdefault("endpoint_url", bucket.endpoint)
    return S3Storage(
        bucket.bucket,
        prefix,
        region=bucket.region,
        access_key=bucket.access_key,
        secret_key=bucket.secret_key,
        **kw,
    )


def test_put_get_head_list_delete(s3_bucket: Any) -> None:
    s = store(s3_bucket)
    assert s.uri == f"s3://{s3_bucket.bucket}/job"
    assert s.head("cuts/1/a.json") is None
    s.put_bytes("cuts/1/a.json", b"hello")
    s.put_bytes("cuts/1/w/b.bin", b"x" * 100)
    s.put_bytes("cuts/2/c", b"")
    store(s3_bucket, "other").put_bytes("cuts/1/a.json", b"not mine")
    assert s.get_bytes("cuts/1/a.json") == b"hello"
    assert s.head("cuts/1/w/b.bin").size == 100  # type: ignore[union-attr]
    assert [o.key for o in s.list("cuts/1/")] == ["cuts/1/a.json", "cuts/1/w/b.bin"]
    assert [o.key for o in s.list("")] == ["cuts/1/a.json", "cuts/1/w/b.bin", "cuts/2/c"]
    assert s.get_range("cuts/1/w/b.bin", 10, 5) == b"xxxxx"
    with s.open_read("cuts/1/a.json") as f:
        assert f.read() == b"hello"
    s.delete("cuts/1/a.json")
    s.delete("cuts/1/a.json")
    with pytest.raises(ObjectNotFoundError, match=r"cuts/1/a\.json does not exist"):
        s.get_bytes("cuts/1/a.json")


def test_create_only_put_is_refused_once_the_key_exists(s3_bucket: Any, tmp_path: Path) -> None:
    s = store(s3_bucket)
    s.put_bytes("cuts/1/manifest.json", b"first", create_only=True)
    with pytest.raises(ObjectExistsError, match="create-only"):
        s.put_bytes("cuts/1/manifest.json", b"second", create_only=True)
    assert s.get_bytes("cuts/1/manifest.json") == b"first"
    results: list[str] = []
    start = threading.Barrier(6)

    def race(n: int) -> None:
        start.wait()
        try:
            s.put_bytes("cuts/2/manifest.json", f"writer {n}".encode(), create_only=True)
            results.append(f"writer {n}")
        except ObjectExistsError:
            results.append("lost")

    threads = [threading.Thread(target=race, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (winner,) = [r for r in results if r != "lost"]
    assert s.get_bytes("cuts/2/manifest.json") == winner.encode()


def test_multipart_upload_and_parallel_download(s3_bucket: Any, tmp_path: Path) -> None:
    s = store(s3_bucket, multipart_threshold=8 * MiB, part_size=5 * MiB, parallelism=4)
    big = tmp_path / "weights.pt"
    big.write_bytes(os.urandom(23 * MiB + 17))
    assert s.put_file("cuts/1/w/weights.pt", big).size == big.stat().st_size
    uploads = s3_bucket.client().list_multipart_uploads(Bucket=s3_bucket.bucket).get("Uploads", [])
    assert uploads == [], "the multipart upload was completed"
    back = tmp_path / "back.pt"
    assert s.download_file("cuts/1/w/weights.pt", back).size == big.stat().st_size
    assert sha256_file(back) == sha256_file(big)
    # A create-only multipart upload is refused at CompleteMultipartUpload and leaves nothing behind.
    with pytest.raises(ObjectExistsError):
        s.put_file("cuts/1/w/weights.pt", back, create_only=True)
    assert s3_bucket.client().list_multipart_uploads(Bucket=s3_bucket.bucket).get("Uploads", []) == []
    s.close()


def test_streamed_writes_single_put_multipart_and_abort(s3_bucket: Any) -> None:
    s = store(s3_bucket, multipart_threshold=8 * MiB, part_size=5 * MiB, parallelism=3)
    with s.open_write("small") as f:
        f.write(b"a" * 1000)
        f.write(b"b")
    assert s.get_bytes("small") == b"a" * 1000 + b"b"
    payload = os.urandom(27 * MiB + 3)
    with s.open_write("big") as f:
        f.write(payload[:3])  # small writes, then one huge one, as torch.save does
        f.write(payload[3 : 2 * MiB])
        f.write(memoryview(payload)[2 * MiB :])
    assert s.get_bytes("big") == payload
    client = s3_bucket.client()
    with pytest.raises(RuntimeError, match="serialiser failed"):
        write_then_fail(s, "broken", payload)
    assert s.head("broken") is None
    assert client.list_multipart_uploads(Bucket=s3_bucket.bucket).get("Uploads", []) == [], "aborted"
    with pytest.raises(ObjectExistsError), s.open_write("big", create_only=True) as f:
        f.write(payload)
    assert s.get_bytes("big") == payload
    s.close()


def test_credentials_from_a_mounted_secret_folder(
    s3_bucket: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "AWS_ACCESS_KEY_ID").write_text(s3_bucket.access_key + "\n")
    (secret / "AWS_SECRET_ACCESS_KEY").write_text(s3_bucket.secret_key)
    s = S3Storage(s3_bucket.bucket, "p", endpoint_url=s3_bucket.endpoint, credentials_dir=secret)
    s.put_bytes("k", b"v")
    assert s.get_bytes("k") == b"v"
    assert s3_bucket.secret_key not in repr(s)
    (secret / "AWS_SECRET_ACCESS_KEY").write_text("wrong-secret")
    bad = S3Storage(s3_bucket.bucket, "p", endpoint_url=s3_bucket.endpoint, credentials_dir=secret, max_attempts=1)
    with pytest.raises(StorageError, match="access denied") as info:
        bad.get_bytes("k")
    assert "wrong-secret" not in str(info.value)
    (secret / "AWS_SECRET_ACCESS_KEY").unlink()
    with pytest.raises(StorageError, match="lacks AWS_SECRET_ACCESS_KEY"):
        S3Storage(s3_bucket.bucket, endpoint_url=s3_bucket.endpoint, credentials_dir=secret)


def test_endpoint_and_credentials_from_the_environment(
    s3_bucket: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for k, v in s3_bucket.env().items():
        monkeypatch.setenv(k, v)
    from spotrl_runtime.api.rljob import Dataset as DatasetSpec
    from spotrl_runtime.data import open_dataset
    from spotrl_runtime.storage import open_storage

    s = open_storage(f"s3://{s3_bucket.bucket}/from-env")
    s.put_bytes("x", b"1")
    assert s3_bucket.client().get_object(Bucket=s3_bucket.bucket, Key="from-env/x")["Body"].read() == b"1"
    # A JSONL dataset read from S3 through the same storage interface.
    s.put_bytes("data/train.jsonl", b'{"prompt": "1+1=", "answer": "2", "task_name": "add"}\n')
    dataset = open_dataset(DatasetSpec(uri=f"s3://{s3_bucket.bucket}/from-env/data/train.jsonl"))
    assert len(dataset) == 1
    assert dataset[0]["prompt"] == "1+1="
    # And a Parquet one: downloaded once to a local file that goes with the dataset.
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = pa.BufferOutputStream()
    pq.write_table(pa.table({"prompt": ["2+2=", "3+3="], "answer": ["4", "6"]}), buf)
    s.put_bytes("data/train.parquet", buf.getvalue().to_pybytes())
    parquet = open_dataset(DatasetSpec(uri=f"s3://{s3_bucket.bucket}/from-env/data/train.parquet"))
    assert [parquet[i]["prompt"] for i in range(len(parquet))] == ["2+2=", "3+3="]
    local = parquet.path  # type: ignore[attr-defined]
    assert local.is_file()
    del parquet
    gc.collect()
    assert not local.parent.exists(), "the downloaded copy goes with the dataset"
    # And a folder datasets' save_to_disk wrote (a DatasetDict): a prefix ending in '/'.
    import datasets

    from spotrl_runtime.data.hf_disk import HFDiskDataset

    folder = tmp_path / "saved"
    rows = {"train": [{"prompt": "5+5=", "answer": "10"}], "test": [{"prompt": "6+6=", "answer": "12"}]}
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in rows.items()}).save_to_disk(str(folder))
    for f in folder.rglob("*"):
        if f.is_file():
            s.put_bytes(f"data/saved/{f.relative_to(folder).as_posix()}", f.read_bytes())
    saved = open_dataset(DatasetSpec(uri=f"s3://{s3_bucket.bucket}/from-env/data/saved/", split="test"))
    assert isinstance(saved, HFDiskDataset)
    assert saved[0]["prompt"] == "6+6="
    copy = saved.files[0].parent.parent
    del saved
    gc.collect()
    assert not copy.exists(), "the downloaded folder goes with the dataset"


# ------------------------------------------------------------- fault injection


@pytest.mark.parametrize("kind", ["503", "500", "429"])
def test_throttling_and_5xx_are_retried_with_backoff(s3_bucket: Any, fault_proxy: FaultProxy, kind: str) -> None:
    s = store(s3_bucket, endpoint_url=fault_proxy.endpoint, max_attempts=5)
    fault_proxy.add(kind, times=3)  # type: ignore[arg-type]
    s.put_bytes("retried", b"payload")
    assert [m for m, _, _ in fault_proxy.log] == ["PUT"] * 4, "three failures, then success"
    assert s3_bucket.client().get_object(Bucket=s3_bucket.bucket, Key="job/retried")["Body"].read() == b"payload"


def test_persistent_failure_gives_up_with_the_key_named(s3_bucket: Any, fault_proxy: FaultProxy) -> None:
    s = store(s3_bucket, endpoint_url=fault_proxy.endpoint, max_attempts=2)
    fault_proxy.add("503")
    with pytest.raises(StorageError, match=r"job/k failed: SlowDown"):
        s.get_bytes("k")
    assert fault_proxy.requests == 2


def test_create_only_put_whose_response_was_lost_is_not_mistaken_for_a_conflict(
    s3_bucket: Any, fault_proxy: FaultProxy
) -> None:
    """The server stores the manifest, the answer is lost, the retry gets 412: that 412 is our
    own write, and the put succeeds; a different writer's bytes still conflict."""
    s = store(s3_bucket, endpoint_url=fault_proxy.endpoint, max_attempts=3)
    fault_proxy.add("lost_answer", times=1)
    s.put_bytes("cuts/1/manifest.json", b"ours", create_only=True)
    assert [m for m, _, _ in fault_proxy.log][:2] == ["PUT", "PUT"]
    with pytest.raises(ObjectExistsError):
        s.put_bytes("cuts/1/manifest.json", b"theirs", create_only=True)


def write_then_fail(store: Any, key: str, data: bytes) -> None:
    """Writes part of an object, then fails as a serialiser might."""
    with store.open_write(key) as f:
        f.write(data)
        raise RuntimeError("serialiser failed")
