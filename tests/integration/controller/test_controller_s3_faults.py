"""The real controller on a flaky object store: `spotrl run` with its cuts and audit on a real
S3 server (versitygw) behind our fault proxy. A flaky store costs time, never a cut or a
resume; a barrier whose manifest PUT stalls says so and exits 143 within its deadline."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from controller_runs import Runs, assert_same_trainer_state, stop, wait_for

from spotrl_e2e.faultproxy import SEED_VAR, FaultProxy, fault_seed
from spotrl_runtime.checkpoint.layout import list_cut_folders, newest_committed
from spotrl_runtime.controller.audit_store import STEP_PREFIX, AuditStore
from spotrl_runtime.storage.s3 import S3Storage

pytestmark = [pytest.mark.slow, pytest.mark.s3]


DEADLINE = 8
"""The stalled barrier's --sigterm-deadline, seconds."""


def _store(bucket: Any) -> S3Storage:
    """The job's store, read directly (not through the proxy)."""
    return bucket.storage("job")


def _newest_cut(bucket: Any) -> tuple[str, str, int]:
    """(id, kind, trainer step) of the store's newest committed cut: the manifest, not the log,
    says a barrier cut committed (the SIGTERM banner says "barrier cut" whether it did or not)."""
    store = _store(bucket)
    cut_id = newest_committed(store)
    assert cut_id is not None, "no committed cut"
    manifest = json.loads(store.get_bytes(f"cuts/{cut_id}/manifest.json"))
    return cut_id, manifest["kind"], manifest["trainer_step"]


def _stream(bucket: Any) -> list[tuple[int, list[int]]]:
    return [(d["step"], d["idxs"]) for d in AuditStore(_store(bucket)).effective()]


def _steps_audited(bucket: Any) -> int:
    """Steps with a record, from one listing (polled while a run trains: reading every record
    at each look kept a core busy)."""
    return len({o.key.split("/attempt-")[0] for o in _store(bucket).list(STEP_PREFIX) if o.key.endswith(".json")})


def _env(bucket: Any, proxy: FaultProxy) -> dict[str, str]:
    return {**bucket.env(), "AWS_ENDPOINT_URL_S3": proxy.endpoint}


def test_a_run_preempted_and_resumed_under_heavy_faults_trains_the_baseline(
    runs: Runs, baseline: list[tuple[int, list[int]]], s3_bucket: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    job, uri = runs.job(), f"s3://{s3_bucket.bucket}/job"
    seed = fault_seed()  # SPOTRL_FAULT_SEED replays a failed run's
    with FaultProxy(s3_bucket.endpoint, seed=seed) as proxy:
        proxy.add_mix()
        env = _env(s3_bucket, proxy)
        first = runs.start(job, uri, **env)
        wait_for(lambda: _steps_audited(s3_bucket) >= 6, 300, "six steps audited", first, interval=0.25)
        rc = stop(first, signal.SIGTERM)
        log = runs.log_of(first)
        assert rc == 143, log
        # The barrier cut committed, under faults: read now (retention may delete it later).
        cut_id, kind, cut_step = _newest_cut(s3_bucket)
        assert kind == "barrier", (cut_id, kind, log[-3000:])
        assert re.search(rf"barrier cut {cut_id} committed at step {cut_step} ", log), log[-3000:]
        trained = {d["step"] for d in AuditStore(_store(s3_bucket)).documents()}
        assert cut_step == len(trained) >= 6, (cut_step, sorted(trained))
        rc, log = runs.run(job, uri, **env)
        assert rc == 0, log
        assert f"resumed from cut {cut_id} (barrier) at step {cut_step}" in log, log[-3000:]
        requests, faults = proxy.requests, dict(proxy.faults)
    cuts = len([f for f in list_cut_folders(_store(s3_bucket)) if f.committed])
    with capsys.disabled():
        print(
            f"\nfault figures (controller, SIGTERM + resume, {SEED_VAR}={seed}): requests {requests}, "
            f"faults {faults}, cuts kept {cuts}"
        )
    assert sum(faults.values()) > requests // 5, "the mix really failed many requests"
    # The resume started at the cut: no step was trained twice. (Not the restore count: the
    # restore record is a report its attempt may fail to write under this fault mix.)
    assert AuditStore(_store(s3_bucket)).accounting().steps_retrained == 0
    assert _stream(s3_bucket) == [(s, idxs) for s, idxs in baseline]
    assert_same_trainer_state(_store(s3_bucket), runs.base / "baseline")


def test_a_barrier_whose_manifest_put_stalls_exits_143_within_its_deadline(
    runs: Runs, baseline: list[tuple[int, list[int]]], s3_bucket: Any, tmp_path: Path
) -> None:
    job, uri = runs.job(), f"s3://{s3_bucket.bucket}/job"
    with FaultProxy(s3_bucket.endpoint) as proxy:
        # The worker holds its batches from step 6's weights on: the run is still training when
        # the SIGTERM comes, not already past its last step (a tiny step takes a tenth of a
        # second, and the run had ended in the second before the signal).
        env = {**_env(s3_bucket, proxy), "SPOTRL_FAILPOINTS": "worker.generate@6+=300"}
        env["SPOTRL_FAILPOINT_DIR"] = str(tmp_path)
        # Time enough to reach the manifest on a loaded host (a step in progress, the files), not
        # enough to outlast the stall: a shorter one can run out before the manifest on a loaded CI machine.
        first = runs.start(job, uri, "--sigterm-deadline", str(DEADLINE), **env)
        wait_for(lambda: _steps_audited(s3_bucket) >= 5, 300, "five steps audited", first, interval=0.25)
        proxy.add("stall", method="PUT", key="manifest.json")  # never answered
        # A manifest the proxy took before the rule is answered: its cut may commit a moment
        # later, legitimately. What committed is read once that moment has passed.
        time.sleep(1.0)
        committed = {f.cut_id for f in list_cut_folders(_store(s3_bucket)) if f.committed}
        t0 = time.monotonic()
        rc = stop(first, signal.SIGTERM)
        took = time.monotonic() - t0
        log = runs.log_of(first)
        assert rc == 143, log
        assert took < DEADLINE + 5 + 10, f"SIGTERM to exit took {took:.1f} s"
        assert "missed its deadline" in log
        assert "Traceback" not in log
        assert proxy.faults["stall"] >= 1, f"the barrier never reached its manifest:\n{log[-3000:]}"
    now = {f.cut_id for f in list_cut_folders(_store(s3_bucket)) if f.committed}
    assert now == committed, "no cut committed after the stall, and none was torn into a commit"
    rc, log = runs.run(job, uri, **s3_bucket.env())
    assert rc == 0, log
    assert _stream(s3_bucket) == [(s, idxs) for s, idxs in baseline]
    assert_same_trainer_state(_store(s3_bucket), runs.base / "baseline")
