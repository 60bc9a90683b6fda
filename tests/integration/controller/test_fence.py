"""Two controllers on one store never both train: the newer one claims the job, and the older
one, fenced, stops within the step it is in (exit 4, the fence named) and audits and cuts
nothing more. The run then trains exactly the baseline's prompts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from controller_runs import Runs, assert_same_trainer_state, audit, stream, wait_for

from spotrl_runtime.checkpoint.fence import claimed_attempts
from spotrl_runtime.checkpoint.layout import list_cut_folders, manifest_key
from spotrl_runtime.controller.audit_store import AuditStore
from spotrl_runtime.storage import open_storage

pytestmark = pytest.mark.slow


def pointer_step(storage: Path) -> int | None:
    """The trainer step of the cut LATEST.json names (None: no cut yet)."""
    pointer = storage / "LATEST.json"
    return json.loads(pointer.read_text())["trainer_step"] if pointer.exists() else None


def test_a_fenced_controller_stops_and_writes_nothing_more(
    runs: Runs, baseline: list[tuple[int, list[int]]], tmp_path: Path
) -> None:
    storage = tmp_path / "store"
    marks = tmp_path / "marks"
    marks.mkdir()
    job = runs.job()
    # The first controller sleeps inside optimizer step 5, after its cut at step 5 (the delta
    # captured once step 4 committed).
    old = runs.start(job, storage, SPOTRL_FAILPOINTS="train.step@5=120", SPOTRL_FAILPOINT_DIR=str(marks))
    wait_for(lambda: (marks / "train.step").exists(), 300, "the first controller to reach step 5", old)
    wait_for(lambda: pointer_step(storage) == 5, 30, "its cut of step 5 (the delta after step 4)")

    # A second `spotrl run` on the same store: attempt 1 claims the job and resumes.
    new = runs.start(job, storage)
    wait_for(lambda: claimed_attempts(open_storage(str(storage))) == [0, 1], 120, "the second claim", new)
    trained = AuditStore(open_storage(str(storage)))  # read in place: a `spotrl audit` each look kept a core busy
    wait_for(lambda: trained.latest_attempt() == 1, 300, "the second to train", new)

    (marks / "train.step.release").touch()  # the first finishes step 5 and meets the fence
    rc = old.wait(timeout=60)
    log = runs.log_of(old)
    assert rc == 4, log
    assert "fenced: controller attempt 1 claimed" in log
    # It stops within the step it was in: step 5 is its last, the fence right after it. (Not a
    # wall-clock bound: the exit includes Ray's teardown, which a loaded CI machine stretches.)
    steps = [int(m) for m in re.findall(r"step +(\d+)/", log)]
    assert steps[-1] == 5, steps
    assert log.index("fenced: controller attempt 1") > log.rindex("step    5/"), log

    rc = new.wait(timeout=420)
    assert rc == 0, runs.log_of(new)
    records = audit(storage, "--all")
    assert [d["step"] for d in records if d["attempt"] == 0] == [0, 1, 2, 3, 4], "step 5 was never audited"
    store = open_storage(str(storage))
    manifests = [json.loads(store.get_bytes(manifest_key(f.cut_id))) for f in list_cut_folders(store) if f.committed]
    assert all(m["trainer_step"] <= 5 for m in manifests if m["attempt"] == 0), "the fenced one cut nothing more"
    assert any(m["attempt"] == 1 for m in manifests)
    assert stream(storage) == baseline
    assert_same_trainer_state(storage, runs.base / "baseline")


def test_a_job_pointed_at_another_jobs_store_is_refused_and_fences_nobody(
    runs: Runs, baseline: list[tuple[int, list[int]]], tmp_path: Path
) -> None:
    """The slip of two jobs on one --storage: the second is refused before it writes anything
    (no claim, no audit, no cut), so the first is never fenced and trains the baseline's prompts."""
    storage = tmp_path / "shared-store"
    marks = tmp_path / "marks"
    marks.mkdir()
    first = runs.start(runs.job(), storage, SPOTRL_FAILPOINTS="train.step@5=120", SPOTRL_FAILPOINT_DIR=str(marks))
    wait_for(lambda: (marks / "train.step").exists(), 300, "the first job to reach step 5", first)

    def files() -> dict[str, bytes]:
        return {str(p.relative_to(storage)): p.read_bytes() for p in sorted(storage.rglob("*")) if p.is_file()}

    # The delta after step 4 is its last cut before the hold: once the pointer names it and its
    # retention is done, nothing more is written.
    wait_for(lambda: pointer_step(storage) == 5, 30, "its cut of step 5")
    seen = [files()]
    wait_for(lambda: seen.append(files()) or seen[-1] == seen[-2], 30, "the first job's writes to settle")
    before = seen[-1]
    other = runs.job()
    other.write_text(other.read_text().replace("name: tiny", "name: tiny-b"))
    rc, log = runs.run(other, storage, "--max-steps", "3", timeout=180)
    assert rc == 3, log
    assert "[job_identity]" in log
    assert "the store belongs to job 'tiny', not 'tiny-b'; point the job at its own checkpoint storage" in log
    assert files() == before, "the refused job wrote into the other job's store"

    (marks / "train.step.release").touch()
    rc = first.wait(timeout=420)
    log = runs.log_of(first)
    assert rc == 0, log
    assert "fenced" not in log
    assert claimed_attempts(open_storage(str(storage))) == [0]
    assert stream(storage) == baseline
