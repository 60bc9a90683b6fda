"""The S3 store behind a fault-injecting proxy (spotrl_e2e.faultproxy) in front of a real S3
server: every fault kind on reads and writes, a reset in the middle of a download, a heavy
random mix, and deadlines that bound stalled and retried calls."""

from __future__ import annotations

import hashlib
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest

from spotrl_e2e.faultproxy import FAULT_KINDS, FaultKind, FaultProxy
from spotrl_runtime.api.times import Deadline
from spotrl_runtime.storage import ObjectExistsError, StorageDeadlineError, StorageError, deadline_scope
from spotrl_runtime.storage.s3 import S3Storage

pytestmark = pytest.mark.s3
MiB = 1024 * 1024


def store(bucket: Any, proxy: FaultProxy | None, prefix: str = "job", **kw: Any) -> S3Storage:
    kw.setdefault("backoff_base", 0.01)
    kw.setdefault("read_timeout", 1.0)
    kw.setdefault("connect_timeout", 1.0)
    return S3Storage(
        bucket.bucket,
        prefix,
        endpoint_url=proxy.endpoint if proxy else bucket.endpoint,
        region=bucket.region,
        access_key=bucket.access_key,
        secret_key=bucket.secret_key,
        **kw,
    )


def on_server(bucket: Any, key: str) -> bytes:
    """The object as the server holds it (read directly, not through the proxy)."""
    return bytes(bucket.client().get_object(Bucket=bucket.bucket, Key=f"job/{key}")["Body"].read())


# A stall longer than the 0.5 s read timeout these tests use: the attempt times out and is retried.
STALL = 0.8


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_every_fault_kind_on_a_create_only_put(s3_bucket: Any, fault_proxy: FaultProxy, kind: FaultKind) -> None:
    s = store(s3_bucket, fault_proxy, read_timeout=0.5)
    data = os.urandom(100_000)
    fault_proxy.add(kind, method="PUT", key="obj", times=1, seconds=STALL)
    s.put_bytes("obj", data, create_only=True)
    assert fault_proxy.faults[kind] == 1
    assert on_server(s3_bucket, "obj") == data
    if kind != "reset_after":  # a reset after a whole answer costs no retry
        assert s.retries >= 1
    # Lost answers made the retry meet our own object (412): still not a conflict. A real
    # conflict still is one.
    with pytest.raises(ObjectExistsError):
        s.put_bytes("obj", b"someone else", create_only=True)


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_every_fault_kind_on_reads(s3_bucket: Any, fault_proxy: FaultProxy, kind: FaultKind) -> None:
    s = store(s3_bucket, fault_proxy, read_timeout=0.5)
    data = os.urandom(300_000)
    s.put_bytes("obj", data)
    fault_proxy.add(kind, method="GET", key="obj", times=1, seconds=STALL)
    assert s.get_bytes("obj") == data
    fault_proxy.add(kind, method="GET", key="obj", times=1, seconds=STALL)
    assert s.get_range("obj", 1000, 5000) == data[1000:6000]
    fault_proxy.add(kind, method="HEAD", key="obj", times=1, seconds=STALL)
    info = s.head("obj")
    assert info is not None
    assert info.size == len(data)
    fault_proxy.add(kind, method="GET", key="job/", times=1, seconds=STALL)  # the listing
    assert [o.key for o in s.list("")] == ["obj"]
    assert fault_proxy.faults[kind] == 4
    if kind != "reset_after":
        assert s.retries >= 4


def test_a_reset_in_the_middle_of_a_download_is_retried(
    s3_bucket: Any, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    """The answer's headers and half its body arrive, then the connection resets: the read is
    retried (whole: never a mix of two attempts) for a whole object, a range, a streamed
    read and the parallel ranged download."""
    s = store(s3_bucket, fault_proxy, multipart_threshold=8 * MiB, part_size=5 * MiB, parallelism=3)
    small = os.urandom(2 * MiB + 7)
    big = tmp_path / "big"
    big.write_bytes(os.urandom(17 * MiB + 3))
    s.put_bytes("small", small)
    s.put_file("big", big)
    fault_proxy.add("reset_body", method="GET", times=2)
    assert s.get_bytes("small") == small
    assert fault_proxy.faults["reset_body"] == 2, "two attempts broke mid-body, the third read it all"
    fault_proxy.add("reset_body", method="GET", times=1)
    assert s.get_range("small", 5, MiB) == small[5 : 5 + MiB]
    fault_proxy.add("reset_body", method="GET", times=1)
    with s.open_read("small") as f:
        assert f.read() == small
    assert fault_proxy.faults["reset_body"] == 4
    fault_proxy.add("reset_body", method="GET", key="big", probability=0.5)
    back = tmp_path / "back"
    assert s.download_file("big", back).size == big.stat().st_size
    assert hashlib.sha256(back.read_bytes()).digest() == hashlib.sha256(big.read_bytes()).digest()
    assert s.retries == fault_proxy.faults["reset_body"] >= 4
    assert s.retried["ResponseStreamingError"] >= 1
    s.close()


def test_a_fault_that_never_ends_gives_a_clear_error(s3_bucket: Any, fault_proxy: FaultProxy) -> None:
    s = store(s3_bucket, fault_proxy, max_attempts=3)
    s.put_bytes("obj", b"x" * 1000)
    fault_proxy.add("reset_body", method="GET")
    with pytest.raises(StorageError, match=r"get s3://.*/job/obj failed: .*gave up after 3 attempts"):
        s.get_bytes("obj")
    fault_proxy.add("503", method="PUT")
    with pytest.raises(StorageError, match=r"put s3://.*/job/other failed: SlowDown.*3 attempts") as info:
        s.put_bytes("other", b"y")
    assert not info.value.in_doubt, "a 503 is a refusal: the PUT did not land"
    fault_proxy.clear()
    fault_proxy.add("lost_answer", method="PUT")
    with pytest.raises(StorageError) as lost:
        s.put_bytes("third", b"z")
    assert lost.value.in_doubt, "a lost answer leaves the write in doubt"
    assert on_server(s3_bucket, "third") == b"z"


@pytest.mark.parametrize("seed", [1, 2])
def test_transfers_under_a_heavy_random_mix_of_faults(
    s3_bucket: Any, s3_server: Any, tmp_path: Path, seed: int, capsys: pytest.CaptureFixture[str]
) -> None:
    with FaultProxy(s3_server.endpoint, seed=seed) as proxy:
        proxy.add_mix()
        s = store(s3_bucket, proxy, multipart_threshold=6 * MiB, part_size=5 * MiB, parallelism=3)
        rng = random.Random(seed)
        objects = {f"o/{i}": rng.randbytes(rng.choice([0, 1, 1000, 70_000, 600_000])) for i in range(24)}
        for key, data in objects.items():
            s.put_bytes(key, data, create_only=rng.random() < 0.5)
        big = tmp_path / "big"
        big.write_bytes(rng.randbytes(13 * MiB + 5))
        s.put_file("big", big)
        streamed = rng.randbytes(11 * MiB + 1)
        with s.open_write("streamed") as f:
            f.write(streamed[:100])
            f.write(streamed[100:])
        for key, data in objects.items():
            assert s.get_bytes(key) == data, key
        assert [o.key for o in s.list("o/")] == sorted(objects)
        back = tmp_path / "back"
        s.download_file("big", back)
        assert back.read_bytes() == big.read_bytes()
        assert s.get_bytes("streamed") == streamed
        for key in list(objects)[:12]:
            s.delete(key)
        assert len(list(s.list("o/"))) == 12
        s.close()
        requests, faults = proxy.requests, dict(proxy.faults)
    assert sum(faults.values()) >= 0.25 * requests
    # Every fault costs a retry, but a reset after a whole answer and a short stall.
    costly = sum(n for kind, n in faults.items() if kind not in ("reset_after", "stall", "stall_answer"))
    assert s.retries >= costly
    with capsys.disabled():
        print(f"\nfault figures (transfers, seed {seed}): requests {requests}, faults {faults}, retries {s.retries}")


@pytest.mark.alone
def test_a_stalled_put_is_abandoned_at_the_deadline(s3_bucket: Any, fault_proxy: FaultProxy, tmp_path: Path) -> None:
    s = store(s3_bucket, fault_proxy, read_timeout=30.0, multipart_threshold=6 * MiB, part_size=5 * MiB)
    fault_proxy.add("stall", method="PUT", key="stalled")  # never answers
    t0 = time.monotonic()
    with deadline_scope(Deadline.after(0.8)), pytest.raises(StorageDeadlineError, match="abandoned") as info:
        s.put_bytes("stalled", b"x")
    assert time.monotonic() - t0 < 0.8 + 0.3
    assert info.value.in_doubt
    # The part threads see the deadline too: a stalled part is abandoned.
    big = tmp_path / "big"
    big.write_bytes(os.urandom(12 * MiB))
    t0 = time.monotonic()
    with deadline_scope(Deadline.after(1.0)), pytest.raises(StorageDeadlineError):
        s.put_file("stalled-big", big)
    assert time.monotonic() - t0 < 1.0 + 0.5
    # Backoff never sleeps past the deadline: a 503, then a backoff (2.5 s or more) longer
    # than the time left: it gives up at once.
    slow = store(s3_bucket, fault_proxy, backoff_base=5.0)
    fault_proxy.add("503", method="GET")
    t0 = time.monotonic()
    with deadline_scope(Deadline.after(2.0)), pytest.raises(StorageDeadlineError, match="leaves no time"):
        slow.get_bytes("anything")
    assert time.monotonic() - t0 < 1.0
    # Past the deadline nothing starts.
    with deadline_scope(Deadline.after(0.0)), pytest.raises(StorageDeadlineError, match="not started"):
        s.head("anything")
    s.close()
