"""Cuts and resumes through a fault-injecting proxy in front of the real S3 server: a flaky
object store costs time, never a cut or a resume. The manifest whose answer was lost, a
stalled barrier PUT, how a failed manifest write is settled, and whole runs under faults
that train the same effective stream as a run without them."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from cut_scenarios import DATASET, EXAMPLE_B, Run, example_b_before_cut

from spotrl_e2e.faultproxy import FaultProxy
from spotrl_runtime.api.times import Deadline
from spotrl_runtime.checkpoint import (
    BarrierDeadlineMissedError,
    CutConflictError,
    CutError,
    CutRequest,
    DatasetLookup,
    list_cut_folders,
    newest_committed,
    read_pointer,
    validate_stored_cut,
)
from spotrl_runtime.checkpoint.layout import manifest_key
from spotrl_runtime.checkpoint.writer import CLEANUP_GRACE
from spotrl_runtime.core.audit import AuditRecord, effective_stream
from spotrl_runtime.data import PromptCollate
from spotrl_runtime.storage import LocalStorage, ObjectInfo, StorageError
from spotrl_runtime.storage.s3 import S3Storage

pytestmark = pytest.mark.s3


def store(bucket: Any, endpoint: str, prefix: str = "jobs/faults", **kw: Any) -> S3Storage:
    kw.setdefault("backoff_base", 0.01)
    return S3Storage(
        bucket.bucket,
        prefix,
        endpoint_url=endpoint,
        region=bucket.region,
        access_key=bucket.access_key,
        secret_key=bucket.secret_key,
        **kw,
    )


def lookup() -> DatasetLookup:
    return DatasetLookup(DATASET, PromptCollate())


def test_a_manifest_whose_answer_was_lost_and_cannot_be_read_back_keeps_its_files(
    s3_bucket: Any, fault_proxy: FaultProxy
) -> None:
    """The manifest PUT lands, its answer is lost, the retry meets it (412) and reading it back
    fails: the commit state is unknown, so the files stay, and the cut, which *is* committed,
    validates and is what a later restore uses."""
    storage = store(s3_bucket, fault_proxy.endpoint, max_attempts=3)
    run = example_b_before_cut(storage)
    first = run.cut()
    run.drain(2)
    fault_proxy.add("lost_answer", method="PUT", key="manifest.json", times=1)
    fault_proxy.add("500", method="GET", key="0000000002/manifest.json")  # every read-back fails
    with pytest.raises(CutError, match="unknown: its files are kept") as info:
        run.cut()
    assert not isinstance(info.value, CutConflictError)
    fault_proxy.clear()
    assert fault_proxy.faults["lost_answer"] == 1
    assert fault_proxy.faults["500"] == 6, "two read-backs (storage's, then the writer's), 3 attempts each"
    second = newest_committed(storage)
    assert second is not None
    assert second > first.cut_id, "the manifest landed"
    (folder,) = [f for f in list_cut_folders(storage) if f.cut_id == second]
    assert len(folder.keys) >= 8, "the committed cut's files are all there"
    validated = validate_stored_cut(storage, second, lookup())
    assert validated.manifest.trainer_step == 2
    restored = Run.restore(EXAMPLE_B, DATASET, storage)
    assert restored.owners.trainer_step == 2
    assert restored.weights() == run.weights()


def test_a_manifest_whose_answers_are_all_lost_is_committed(s3_bucket: Any, fault_proxy: FaultProxy) -> None:
    """Every answer to the manifest PUT is lost (the first attempt landed): the writer reads the
    manifest back, finds its own bytes, and the cut is committed."""
    storage = store(s3_bucket, fault_proxy.endpoint, max_attempts=3)
    run = example_b_before_cut(storage)
    fault_proxy.add("lost_answer", method="PUT", key="manifest.json")
    cut = run.cut()
    assert fault_proxy.faults["lost_answer"] == 3
    assert newest_committed(storage) == cut.cut_id
    assert read_pointer(storage)["cut_id"] == cut.cut_id  # type: ignore[index]
    validate_stored_cut(storage, cut.cut_id, lookup())


class ManifestFails(LocalStorage):
    """A folder store whose manifest write fails the chosen way."""

    def __init__(self, root: Path, mode: str):
        super().__init__(root)
        self.mode = mode

    def put_bytes(self, key: str, data: bytes, *, create_only: bool = False) -> ObjectInfo:
        if not key.endswith("manifest.json") or self.mode == "ok":
            return super().put_bytes(key, data, create_only=create_only)
        if self.mode == "other":  # another writer's manifest lands meanwhile
            super().put_bytes(key, b'{"writer": "someone else"}', create_only=True)
        if self.mode == "landed":  # ours lands, the answer is lost
            super().put_bytes(key, data, create_only=True)
        raise StorageError(f"put {key}: injected ({self.mode})", in_doubt=self.mode != "never")


@pytest.mark.parametrize(
    ("mode", "outcome", "files_kept"),
    [
        ("landed", None, True),
        ("other", CutConflictError, False),
        ("maybe", "may still land", True),
        ("never", "writing its manifest failed", False),
    ],
)
def test_a_failed_manifest_write_is_settled_by_reading_it_back(
    tmp_path: Path, mode: str, outcome: Any, files_kept: bool
) -> None:
    storage = ManifestFails(tmp_path, "ok")
    run = example_b_before_cut(storage)
    first = run.cut()
    storage.mode = mode
    if outcome is None:
        assert run.cut().cut_id == "0000000002"
    elif isinstance(outcome, str):
        with pytest.raises(CutError, match=outcome):
            run.cut()
    else:
        with pytest.raises(outcome):
            run.cut()
    folders = {f.cut_id: f for f in list_cut_folders(LocalStorage(tmp_path))}
    data = [k for k in folders.get("0000000002", folders[first.cut_id]).keys if not k.endswith("manifest.json")]
    if "0000000002" in folders:
        assert bool(data) == files_kept
    else:
        assert not files_kept


@pytest.mark.alone
def test_a_stalled_barrier_put_misses_its_deadline_in_time(s3_bucket: Any, fault_proxy: FaultProxy) -> None:
    """The server never answers the barrier cut's manifest PUT (the 60 s read timeout would
    hold it): the barrier gives up at its deadline, names it, and the last committed cut stands."""
    storage = store(s3_bucket, fault_proxy.endpoint, read_timeout=60.0)
    run = example_b_before_cut(storage)
    assert run.writer is not None
    first = run.cut()
    fault_proxy.add("stall", method="PUT", key="manifest.json")  # forever
    t0 = time.monotonic()
    with pytest.raises(BarrierDeadlineMissedError, match=r"missed its deadline.*abandoned") as info:
        run.writer.write(run.owners, CutRequest.barrier(Deadline.after(1.5)), run.state_fn)
    elapsed = time.monotonic() - t0
    assert elapsed < 1.5 + 0.5, f"the barrier took {elapsed:.1f} s"
    assert "files are kept" in str(info.value), "an abandoned manifest PUT may still land"
    fault_proxy.clear()
    assert newest_committed(storage) == first.cut_id
    assert read_pointer(storage)["cut_id"] == first.cut_id  # type: ignore[index]
    assert storage.head(manifest_key("0000000002")) is None
    # A stall while the files go up: the barrier misses, and removes its files (in a short grace).
    fault_proxy.add("stall", method="PUT", key="trainer/")
    t0 = time.monotonic()
    with pytest.raises(BarrierDeadlineMissedError, match="while its files were written"):
        run.writer.write(run.owners, CutRequest.barrier(Deadline.after(1.0)), run.state_fn)
    assert time.monotonic() - t0 < 1.0 + CLEANUP_GRACE + 0.5
    fault_proxy.clear()
    assert newest_committed(storage) == first.cut_id
    # Without faults, the next cut commits and takes the id the failed barrier did not.
    assert run.cut().cut_id == "0000000002"


def cuts_and_resumes(storage: S3Storage) -> tuple[list[AuditRecord], list[float], int, int]:
    """Cuts (periodic and barrier) and resumes: after each cut one more step is trained and
    then the controller is lost (no cut), and a fresh restore from the store goes on."""
    run = example_b_before_cut(storage)
    records: list[AuditRecord] = []
    cuts = resumes = 0
    run.cut()
    cuts += 1
    for target, kind in ((2, "periodic"), (4, "barrier"), (6, "periodic"), (8, "barrier")):
        run.drain(target)
        run.cut(kind)
        cuts += 1
        run.drain(target + 1)  # trained, never cut: the next attempt trains it again
        records += run.audit
        run = Run.restore(EXAMPLE_B, DATASET, storage)
        resumes += 1
    run.drain(10)
    records += run.audit
    return records, run.weights(), cuts, resumes


@pytest.mark.parametrize("seed", [7, 8])
def test_a_run_under_faults_trains_the_same_stream(
    s3_bucket: Any, s3_server: Any, seed: int, capsys: pytest.CaptureFixture[str]
) -> None:
    clean_records, clean_weights, _, _ = cuts_and_resumes(store(s3_bucket, s3_server.endpoint, "jobs/clean"))
    with FaultProxy(s3_server.endpoint, seed=seed) as proxy:
        proxy.add_mix()
        storage = store(s3_bucket, proxy.endpoint, "jobs/faulty", read_timeout=5.0)
        records, weights, cuts, resumes = cuts_and_resumes(storage)
        requests, faults = proxy.requests, dict(proxy.faults)
    clean = {s: (r.attempt, r.idxs, r.group_ids) for s, r in effective_stream(clean_records).items()}
    faulty = {s: (r.attempt, r.idxs, r.group_ids) for s, r in effective_stream(records).items()}
    assert faulty == clean
    assert sorted(faulty) == list(range(10))
    assert [(r.step, r.attempt) for r in records] == [(r.step, r.attempt) for r in clean_records]
    assert weights == clean_weights
    assert sum(faults.values()) >= 0.25 * requests
    assert storage.retries > 0
    with capsys.disabled():
        print(
            f"\nfault figures (run, seed {seed}): requests {requests}, faults {faults}, retries {storage.retries}, "
            f"cuts {cuts}, resumes {resumes}"
        )
