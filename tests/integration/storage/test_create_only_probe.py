"""The create-only probe a controller runs on an S3 store before it claims anything there: a real
S3 server (versitygw) passes it; the same server behind our fault proxy stripping
``If-None-Match`` from every PUT (a store that ignores the header) is refused by check
``create_only``, naming the store, and ``spotrl run`` exits 3 before Ray starts."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from spotrl_e2e.faultproxy import FaultProxy
from spotrl_runtime.api.rljob import EXIT_REFUSED
from spotrl_runtime.cli import main
from spotrl_runtime.commands import run as run_command
from spotrl_runtime.commands.run import refused_store
from spotrl_runtime.storage import LocalStorage, StorageError
from spotrl_runtime.storage.s3 import PROBES, CreateOnlyIgnoredError, S3Storage, probe_create_only

pytestmark = pytest.mark.s3


def store(bucket: Any, proxy: FaultProxy | None = None, **kw: Any) -> S3Storage:
    return S3Storage(
        bucket.bucket,
        "team/job",
        endpoint_url=proxy.endpoint if proxy else bucket.endpoint,
        region=bucket.region,
        access_key=bucket.access_key,
        secret_key=bucket.secret_key,
        backoff_base=0.01,
        **kw,
    )


def ignoring_if_none_match(bucket: Any, proxy: FaultProxy) -> S3Storage:
    """The store through ``proxy``, which from now on strips ``If-None-Match`` from every PUT."""
    proxy.strip_header("If-None-Match", secret_key=bucket.secret_key, method="PUT")
    return store(bucket, proxy)


def leftovers(bucket: Any) -> list[str]:
    """Keys under the store's probe prefix, read directly on the server."""
    listed = bucket.client().list_objects_v2(Bucket=bucket.bucket, Prefix=f"team/job/{PROBES}/")
    return [o["Key"] for o in listed.get("Contents", [])]


def test_a_store_that_honours_if_none_match_passes_and_keeps_no_probe_key(s3_bucket: Any) -> None:
    probe_create_only(store(s3_bucket))
    assert refused_store(store(s3_bucket)) is None
    assert leftovers(s3_bucket) == []


def test_the_proxy_strips_the_header_and_the_server_still_takes_the_request(
    s3_bucket: Any, fault_proxy: FaultProxy
) -> None:
    """The stripped PUT is signed again: the server overwrites the key (no 412, no 403)."""
    s = ignoring_if_none_match(s3_bucket, fault_proxy)
    s.put_bytes("a key/with+odd=chars", b"first", create_only=True)
    s.put_bytes("a key/with+odd=chars", b"second", create_only=True)
    assert s.get_bytes("a key/with+odd=chars") == b"second"
    assert fault_proxy.strips[0].stripped == 2


def test_a_store_that_ignores_if_none_match_is_refused_by_check_create_only(
    s3_bucket: Any, fault_proxy: FaultProxy
) -> None:
    s = ignoring_if_none_match(s3_bucket, fault_proxy)
    with pytest.raises(CreateOnlyIgnoredError) as refused:
        probe_create_only(s)
    message = str(refused.value)
    assert refused.value.check == "create_only"
    assert message.startswith("create_only: ")
    assert fault_proxy.endpoint in message
    assert repr(s3_bucket.bucket) in message
    assert f"s3://{s3_bucket.bucket}/team/job/{PROBES}/create-only-" in message
    assert "ignores If-None-Match: *" in message
    assert "supports conditional writes" in message
    assert leftovers(s3_bucket) == [], "the probe key is deleted"


def test_refused_store_exits_3_naming_the_check(
    s3_bucket: Any, fault_proxy: FaultProxy, capsys: pytest.CaptureFixture[str]
) -> None:
    assert refused_store(ignoring_if_none_match(s3_bucket, fault_proxy)) == EXIT_REFUSED
    assert capsys.readouterr().err.startswith("spotrl: create_only: the S3 store at ")


def test_a_probe_the_store_fails_proves_nothing_and_refuses_nothing(
    s3_bucket: Any, fault_proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """Only an accepted second put refuses the store: an error answers nothing, and the restore
    meets the store next."""
    fault_proxy.add("500", method="PUT")
    s = store(s3_bucket, fault_proxy, max_attempts=2)
    with pytest.raises(StorageError, match="InternalError") as failed:
        probe_create_only(s)
    assert not isinstance(failed.value, CreateOnlyIgnoredError)
    with caplog.at_level(logging.WARNING, logger="spotrl.storage"):
        assert refused_store(s) is None
    assert "create-only probe not finished" in caplog.text


def test_a_local_folder_is_not_probed(tmp_path: Path) -> None:
    assert refused_store(LocalStorage(tmp_path / "store")) is None
    assert not (tmp_path / "store").exists()


def test_spotrl_run_on_a_store_that_ignores_if_none_match_exits_3_before_anything_starts(
    s3_bucket: Any,
    fault_proxy: FaultProxy,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fault_proxy.strip_header("If-None-Match", secret_key=s3_bucket.secret_key, method="PUT")
    for name, value in {**s3_bucket.env(), "AWS_ENDPOINT_URL_S3": fault_proxy.endpoint}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(run_command, "start_ray_early", _no_ray)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(TINY_JOB))
    rc = main(["run", "-f", str(job), "--storage", f"s3://{s3_bucket.bucket}/team/job", "--device", "cpu"])
    assert rc == EXIT_REFUSED
    err = capsys.readouterr().err
    assert "spotrl: create_only: " in err
    assert "ignores If-None-Match: *" in err
    listed = s3_bucket.client().list_objects_v2(Bucket=s3_bucket.bucket, Prefix="team/job/")
    assert [o["Key"] for o in listed.get("Contents", [])] == [], "nothing written there: no claim, no JOB.json"


def _no_ray(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("Ray started: the refusal comes before it")


TINY_JOB: dict[str, Any] = {
    "apiVersion": "spotrl.dev/v1alpha1",
    "kind": "RLJob",
    "metadata": {"name": "tiny"},
    "spec": {
        "policy": {"model": "builtin:tiny-arith"},
        "dataset": {"uri": "builtin:arithmetic"},
        "reward": {"name": "arithmetic_exact"},
        "generation": {"groupSize": 2, "promptsPerStep": 2, "maxNewTokens": 8},
        "training": {"totalSteps": 2, "microBatchSize": 4},
    },
}
