"""The real controller with a trainer group of FSDP2 ranks (Ray actors, gloo on CPU).

The effective stream does not depend on how many processes train: a run cut with N ranks and
resumed with M trains exactly the prompts of the uninterrupted single-process baseline. The
cut's trainer state is sharded (``dcp/v1``): every rank's files are in the manifest.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import Any

import pytest
from controller_runs import Runs, audit, fsdp, newest_cut, stop, stream, wait_for

from spotrl_runtime.controller.audit_store import AuditStore
from spotrl_runtime.controller.loop import EXIT_RANK_LOST
from spotrl_runtime.storage import open_storage

pytestmark = pytest.mark.slow


def manifest_of(store: Any, cut_id: str) -> dict[str, Any]:
    return dict(json.loads(store.get_bytes(f"cuts/{cut_id}/manifest.json")))


def shards(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in manifest["files"] if f["path"].split("/", 1)[1].startswith("trainer/dcp/")]


def test_a_run_resharded_2_to_1_to_3_ranks_trains_the_baseline(
    runs: Runs, baseline: list[tuple[int, list[int]]], tmp_path: Path
) -> None:
    """One run, three attempts on 2, 1 and 3 ranks (each resumes from the last one's cut, so
    2->1 shrinks and 1->3 grows to a count that does not divide the last one's), trains the
    uninterrupted single process's stream."""
    storage = tmp_path / "cuts"
    cut_id, writers = None, 0
    for ranks, until in ((2, 4), (1, 8), (3, None)):
        rc, log = runs.run(runs.job(fsdp(ranks)), storage, *(["--max-steps", str(until)] if until else []))
        assert rc == 0, log
        assert f"trainer group: {ranks} FSDP2 ranks" in log, log
        if cut_id is not None:
            assert f"resumed from cut {cut_id}" in log, f"{writers} -> {ranks} ranks:\n{log}"
        cut_id, _, step = newest_cut(storage)
        assert step == (until or len(baseline))
        manifest = manifest_of(open_storage(str(storage)), cut_id)
        assert manifest["trainer_format"] == "dcp/v1"
        data = shards(manifest)
        # Data files of every rank that wrote the cut (__<rank>_<n>.distcp), and the index.
        writers_seen = {re.search(r"__(\d+)_\d+\.distcp$", f["path"]) for f in data} - {None}
        assert {int(m.group(1)) for m in writers_seen if m} == set(range(ranks)), data
        assert len([f for f in data if f["path"].endswith("/.metadata")]) == 1, data
        writers = ranks
    assert stream(storage) == baseline
    records = audit(storage, "--all")
    assert sorted(d["step"] for d in records) == [step for step, _ in baseline], "each step trained once"
    assert sorted({d["attempt"] for d in records}) == [0, 1, 2]


@pytest.mark.s3
def test_barriers_of_two_ranks_to_s3_before_a_periodic_capture_and_mid_step_then_one_process_resumes(
    runs: Runs, baseline: list[tuple[int, list[int]]], s3_bucket: Any, tmp_path: Path
) -> None:
    """Two preemptions of a 2-rank group, each a barrier cut whose shards go to S3 straight from
    both ranks, then a single-process trainer (strategy single) reads the last one back (a job
    may drop FSDP when its policy fits again): nothing is lost or trained twice.

    The first is the race a drain once lost: step 4 is trained and its periodic cut is about to
    be captured when SIGTERM asks for a barrier; the barrier's capture is taken first, then the
    periodic one arrives. A rank keeps one capture, so it must refuse the periodic one rather
    than replace the barrier's (which then had nothing to write). The second comes mid-step
    (step 6): the ranks finish it, and the barrier holds it."""
    uri = f"s3://{s3_bucket.bucket}/fsdp"
    store = s3_bucket.storage("fsdp")
    from spotrl_runtime.checkpoint.layout import newest_committed

    def barrier_of_both_ranks(log: str, step: int) -> str:
        cut_id = newest_committed(store)
        assert cut_id is not None, log
        manifest = manifest_of(store, cut_id)
        assert manifest["kind"] == "barrier", manifest["kind"]
        trained = len(AuditStore(store).documents())
        assert manifest["trainer_step"] == trained == step, "the barrier holds every step trained"
        files = shards(manifest)
        assert {re.search(r"__(\d+)_", f["path"]).group(1) for f in files if "distcp" in f["path"]} == {"0", "1"}, files  # type: ignore[union-attr]
        for f in files:  # every shard the manifest names is there, with its size
            info = store.head(f"cuts/{cut_id}/{f['path']}")
            assert info is not None, f
            assert info.size == f["size"], f
        return cut_id

    marks = tmp_path / "marks-1"
    marks.mkdir()
    points = "cut.periodic@4=120,cut.captured=120"
    env = {**s3_bucket.env(), "SPOTRL_FAILPOINTS": points, "SPOTRL_FAILPOINT_DIR": str(marks)}
    job = runs.job({**fsdp(2), "checkpoint.barrier": "full"})  # the ranks' shards in every barrier cut
    proc = runs.start(job, uri, **env)
    wait_for(lambda: (marks / "cut.periodic").exists(), 300, "step 4's periodic cut", proc)
    proc.send_signal(signal.SIGTERM)
    wait_for(lambda: (marks / "cut.captured").exists(), 60, "the barrier's capture", proc)
    (marks / "cut.periodic.release").touch()  # the periodic capture now comes after the barrier's
    refused = "periodic cut (every 4 steps) not taken: rank"
    wait_for(lambda: refused in runs.log_of(proc), 60, "the periodic capture refused", proc)
    (marks / "cut.captured.release").touch()
    rc = proc.wait(timeout=120)
    log = runs.log_of(proc)
    assert rc == 143, log
    assert re.search(r"barrier cut \S+ committed at step 4 ", log), log
    assert "no captured state" not in log, log
    cut_id = barrier_of_both_ranks(log, 4)

    marks = tmp_path / "marks-2"
    marks.mkdir()
    env = {**s3_bucket.env(), "SPOTRL_FAILPOINTS": "train.step@6=3", "SPOTRL_FAILPOINT_DIR": str(marks)}
    proc = runs.start(job, uri, **env)
    wait_for(lambda: (marks / "train.step").exists(), 300, "step 6", proc)
    rc = stop(proc, signal.SIGTERM)
    log = runs.log_of(proc)
    assert rc == 143, log
    assert f"resumed from cut {cut_id} (barrier) at step 4" in log, log
    cut_id = barrier_of_both_ranks(log, 7)

    rc, log = runs.run(runs.job(), uri, **s3_bucket.env())
    assert rc == 0, log
    assert f"resumed from cut {cut_id} (barrier) at step 7" in log, log
    records = AuditStore(store).documents()
    assert sorted(d["step"] for d in records) == [step for step, _ in baseline], "each step trained once"
    assert [(d["step"], d["idxs"]) for d in AuditStore(store).effective()] == baseline


def test_a_delta_barrier_of_two_ranks_is_redone_on_three_and_on_one(
    runs: Runs, baseline: list[tuple[int, list[int]]], tmp_path: Path
) -> None:
    """A delta barrier cut of a 2-rank group (no shards: the owners and the redo rows since the
    periodic cut of step 4), then two resumes of copies of it: on 3 ranks and on 1. Each loads the
    base's shards into its own rank count, redoes the steps (loss and gradient norm within the
    tolerance) and trains the baseline's prompts after them."""
    import shutil

    storage, marks = tmp_path / "cuts", tmp_path / "marks"
    marks.mkdir()
    proc = runs.start(
        runs.job({**fsdp(2), "checkpoint.barrier": "delta"}),
        storage,
        SPOTRL_FAILPOINTS="train.step@6=3",
        SPOTRL_FAILPOINT_DIR=str(marks),
    )
    wait_for(lambda: (marks / "train.step").exists(), 300, "step 6", proc)
    assert stop(proc, signal.SIGTERM) == 143, runs.log_of(proc)
    cut_id, kind, step = newest_cut(storage)
    manifest = manifest_of(open_storage(str(storage)), cut_id)
    assert (kind, step, manifest["form"], manifest["base"]["trainer_step"]) == ("barrier", 7, "delta", 4), manifest
    assert shards(manifest) == [], "a delta holds no shards"
    for ranks, until in ((3, 9), (1, 8)):
        copy = tmp_path / f"on-{ranks}"
        shutil.copytree(storage, copy)
        rc, log = runs.run(runs.job(fsdp(ranks)), copy, "--max-steps", str(until))
        assert rc == 0, log
        assert f"trainer group: {ranks} FSDP2 ranks" in log, log
        assert f"redid steps 4..6 of delta cut {cut_id}" in log, log
        assert stream(copy) == baseline[:until]


def test_a_rank_killed_without_notice_exits_rank_lost_and_the_next_run_retrains_on_the_same_prompts(
    runs: Runs, baseline: list[tuple[int, list[int]]], tmp_path: Path
) -> None:
    import os

    storage, marks = tmp_path / "cuts", tmp_path / "marks"
    marks.mkdir()
    job = runs.job(fsdp(2))
    proc = runs.start(job, storage, SPOTRL_FAILPOINTS="train.step@6=2", SPOTRL_FAILPOINT_DIR=str(marks))
    wait_for(lambda: (marks / "train.step").exists(), 300, "step 6", proc)
    pids = re.search(r"trainer group: 2 FSDP2 ranks on cpu \(pids \[(\d+), (\d+)\]\)", runs.log_of(proc))
    assert pids is not None, runs.log_of(proc)
    os.kill(int(pids.group(2)), signal.SIGKILL)
    rc = proc.wait(timeout=120)
    log = runs.log_of(proc)
    assert rc == EXIT_RANK_LOST, log
    assert "trainer rank was lost" in log
    cut_id, kind, cut_step = newest_cut(storage)
    assert kind == "periodic"
    assert cut_step == 6, "the delta cut after step 5, the last before the loss"

    rc, log = runs.run(job, storage)
    assert rc == 0, log
    assert f"resumed from cut {cut_id} (periodic) at step 6" in log, log
    assert "redid steps 4..5 of delta cut" in log, "the delta's steps redone from their rows, not generated"
    assert stream(storage) == baseline
    everything = audit(storage, "--all")
    again = sorted(d["step"] for d in everything if d["attempt"] == 1 and d["step"] < 6)
    assert again == [], "nothing before the step in progress is trained again"
    first = {d["step"]: d["prompts"] for d in everything if d["attempt"] == 0}
    assert all(first[d["step"]] == d["prompts"] for d in everything if d["attempt"] == 1 and d["step"] in first), (
        "on the same prompts"
    )
