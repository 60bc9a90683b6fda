"""Delta barrier cuts, made by the real controller (`spotrl run`, real torch, real Ray, cuts on disk).

With ``checkpoint.barrier: delta`` a SIGTERM cuts the owners and the redo log (the rows of every
step trained since the newest full cut, and each step's fingerprint), and no trainer state. The
resume loads the base full cut, trains the redo steps again from their rows (no generation), and
goes on: the effective stream is the uninterrupted run's, and so are the final weights, bit for
bit (one CPU process each). Killed during the redo, or stopped again, it resumes from the same
delta. A delta forged so that one invariant breaks (digests recomputed) is refused by name, and
nothing trains."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from controller_runs import (
    Runs,
    assert_admission_versions,
    assert_same_trainer_state,
    audit,
    final_weights,
    newest_cut,
    stop,
    stream,
    verify,
    wait_for,
)

from spotrl_e2e.forgery import (
    CutSurgery,
    base_of_another_job,
    base_refused_by_its_chain,
    drop_a_redo_row,
    drop_a_redo_step,
    edit_the_base,
    remove_the_base,
    swap_two_redo_groups,
)
from spotrl_runtime.checkpoint.layout import newest_committed
from spotrl_runtime.controller.audit_store import AuditStore
from spotrl_runtime.core.cut_format import decode_rollouts
from spotrl_runtime.storage import open_storage

pytestmark = pytest.mark.slow

JOB = {"checkpoint.barrier": "delta"}
"""The tiny job (16 steps, a periodic full cut every 4) whose barrier cuts are deltas."""


def stopped_at_step_6(runs: Runs, job: Path, store: Path, marks: Path) -> str:
    """Runs ``job`` into ``store`` until it sleeps 4 s before step 6, SIGTERMs it there (the
    barrier cuts a delta on the periodic cut of step 4, its redo log steps 4 and 5) and returns
    the delta's id. ``marks``: an empty folder for the failpoint's mark."""
    proc = runs.start(job, store, SPOTRL_FAILPOINTS="train.step@6=4", SPOTRL_FAILPOINT_DIR=str(marks))
    wait_for(lambda: (marks / "train.step").exists(), 300, "the run to reach step 6", proc)
    assert stop(proc) == 143, runs.log_of(proc)
    log = runs.log_of(proc)
    assert "barrier cut: delta (checkpoint.barrier is delta)" in log, log
    cut_id, kind, step = newest_cut(store)
    assert (kind, step) == ("barrier", 6), log
    return cut_id


def redo_layouts(store: Path, cut_id: str) -> list[str]:
    """The layout each step of a delta's redo log was trained in ("" padded, one update)."""
    redo = json.loads(next((store / "cuts" / cut_id).glob("**/redo.json")).read_text())["steps"]
    return [s["fingerprint"].get("layout", "") for s in redo]


@pytest.fixture(scope="module")
def made(runs: Runs, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """(job file, store, id of a delta barrier cut of step 6 on the full cut of step 4)."""
    job = runs.job(JOB)
    store = runs.base / "delta-source"
    return job, store, stopped_at_step_6(runs, job, store, tmp_path_factory.mktemp("marks"))


def stream_of(store: Any) -> list[tuple[int, list[int]]]:
    """The effective stream of a store (any, S3 too): (step, prompt idxs) per step."""
    return [(d["step"], d["idxs"]) for d in AuditStore(store).effective()]


def _copy(store: Path, to: Path) -> Path:
    shutil.copytree(store, to)
    return to


def test_a_delta_cut_holds_the_owners_and_the_redo_log_and_no_weights(made: tuple[Path, Path, str]) -> None:
    _, store, cut_id = made
    delta = CutSurgery(store / "cuts" / cut_id)
    assert delta.m["form"] == "delta"
    assert delta.m["trainer_format"] is None
    assert not any(f["path"].split("/")[1] == "trainer" for f in delta.m["files"])
    base = CutSurgery(store / "cuts" / delta.m["base"]["cut_id"])
    assert (base.m["form"], base.m["trainer_step"]) == ("full", 4)
    assert delta.m["base"]["manifest_sha256"] == hashlib.sha256(base.manifest_path.read_bytes()).hexdigest()
    redo = delta.json("redo_index")["steps"]
    assert [s["step"] for s in redo] == [4, 5]
    trained = {d["step"]: d for d in audit(store, "--all")}
    for s in redo:
        assert [g["idx"] for g in s["groups"]] == trained[s["step"]]["prompts"]
        assert s["fingerprint"]["where"] == "cpu/1"
    rows = decode_rollouts(delta.path("redo_rows").read_bytes())
    assert sorted(rows) == sorted(g["group_id"] for s in redo for g in s["groups"])
    size = sum(f["size"] for f in delta.m["files"])
    full = sum(f["size"] for f in base.m["files"])
    assert size < full / 5, (size, full)


def test_killed_then_stopped_during_the_redo_the_resume_ends_with_the_uninterrupted_stream_and_weights(
    made: tuple[Path, Path, str], runs: Runs, baseline: list[tuple[int, list[int]]], tmp_path: Path
) -> None:
    job, store, cut_id = made
    root = _copy(store, runs.base / "delta-killed")
    for sig, name in ((signal.SIGKILL, "killed"), (signal.SIGTERM, "stopped")):
        marks = tmp_path / name
        marks.mkdir()
        proc = runs.start(job, root, SPOTRL_FAILPOINTS="redo.step@5=60", SPOTRL_FAILPOINT_DIR=str(marks))
        wait_for(lambda m=marks: (m / "redo.step").exists(), 300, "the redo of step 5", proc)  # type: ignore[misc]
        if sig == signal.SIGKILL:
            assert stop(proc, sig) == -9
        else:
            proc.send_signal(sig)
            (marks / "redo.step.release").touch()  # the step's redo goes on; the next one stops
            assert proc.wait(timeout=60) == 143, runs.log_of(proc)
            assert "stopped during the redo of delta cut" in runs.log_of(proc)
        assert newest_cut(root)[0] == cut_id, "the redo writes nothing: the delta is still the newest cut"
        assert [d for d in audit(root, "--all") if d["attempt"] > 0] == [], "nothing trained"
    # The resumed worker's first generate call is held (the relaunched groups of step 7 wait in
    # the pool) while the trainer trains step 6 from the replay buffer and sends weights 7: the
    # order that once let those groups be generated with weights 7 and the run end elsewhere.
    rc, log = runs.run(job, root, SPOTRL_FAILPOINTS="worker.generate=4")
    assert rc == 0, log
    assert f"resumed from cut {cut_id} (barrier) at step 6" in log, log
    assert f"redid steps 4..5 of delta cut {cut_id}" in log, log
    assert stream(root) == baseline
    # The redone steps are no new training: no attempt after the first audits steps 4 and 5 again.
    assert min(d["step"] for d in audit(root, "--all") if d["attempt"] > 0) == 6
    assert_same_trainer_state(root, runs.base / "baseline")
    assert_admission_versions(root)


MINI_BATCHES = {**JOB, "training.miniBatches": 2, "training.epochs": 2, "training.totalSteps": 8}
"""The same job, each of 8 steps four optimizer updates (two mini-batches, two epochs)."""


def test_a_job_of_mini_batches_resumes_a_delta_as_if_never_stopped_and_another_layout_is_refused(
    runs: Runs, tmp_path: Path
) -> None:
    """PPO-style steps through a stop: a SIGTERM cuts a delta whose redo steps record their
    layout; the resume redoes them bit for bit and ends with the uninterrupted run's stream,
    weights and optimizer (four Adam updates a step). The same delta resumed by a job that now
    says one update a step is refused by the redo, naming the fields."""
    job = runs.job(MINI_BATCHES)
    reference = runs.base / "mini-batches-baseline"
    rc, log = runs.run(job, reference)
    assert rc == 0, log

    store = runs.base / "mini-batches"
    cut_id = stopped_at_step_6(runs, job, store, tmp_path)
    assert redo_layouts(store, cut_id) == ["miniBatches=2,epochs=2,packed"] * 2

    other = _copy(store, runs.base / "mini-batches-other-layout")
    rc, log = runs.run(runs.job({**MINI_BATCHES, "training.miniBatches": 1, "training.epochs": 1}), other)
    assert rc != 0, log
    assert "is redone with one update, packed (training.miniBatches, epochs or packing changed since)" in log, log

    rc, log = runs.run(job, store)
    assert rc == 0, log
    assert f"redid steps 4..5 of delta cut {cut_id}" in log, log
    assert stream(store) == stream(reference)
    assert_same_trainer_state(store, reference)
    steps = final_weights(store, optimizer=True)
    adam = {float(v) for k, v in steps.items() if k.startswith("optimizer/") and k.endswith("/step")}
    assert adam == {4.0 * 8}, "four updates in each of the 8 steps"


def test_a_delta_of_padded_steps_resumes_under_packing_redoing_them_padded(runs: Runs, tmp_path: Path) -> None:
    """A delta cut written by a job that did not pack (as every cut before training.packing) is
    resumed by the job packing (auto, the default now): the redo trains each logged step padded,
    as its fingerprint says it was, so it reproduces them bit for bit, and the steps after it pack."""
    store = runs.base / "padded-delta"
    short = {**JOB, "training.totalSteps": 8}
    cut_id = stopped_at_step_6(runs, runs.job({**short, "training.packing": "off"}), store, tmp_path)
    assert redo_layouts(store, cut_id) == ["", ""]

    rc, log = runs.run(runs.job(short), store)
    assert rc == 0, log
    assert "redo step 4: padded rows, as it was trained" in log, log
    assert f"redid steps 4..5 of delta cut {cut_id}" in log, log
    later = [d for d in audit(store) if d["step"] >= 6]
    assert later, "the steps after the redo trained"
    assert all(d["attempt"] == 1 for d in later)


# ----------------------------------------------------------------------------- forgeries


def forge_delta_of_another_job(c: CutSurgery) -> None:
    c.m["job"] = "another"
    c.save_manifest()


def forge_fingerprint(c: CutSurgery) -> None:
    c.edit_json(
        "redo_index",
        lambda d: d["steps"][-1]["fingerprint"].update(loss=d["steps"][-1]["fingerprint"]["loss"] * 1.0001),
    )


FORGERIES: list[tuple[str, str, Callable[[CutSurgery], None]]] = [
    ("redo_steps", "redo_steps", drop_a_redo_step),
    ("redo_rows", "redo_rows", drop_a_redo_row),
    ("redo_audit", "redo_audit", swap_two_redo_groups),
    ("base_missing", "delta_base", remove_the_base),
    ("base_digest", "delta_base", edit_the_base),
    ("base_of_another_job", "delta_base", base_of_another_job),
    ("base_refused", "delta_base", base_refused_by_its_chain),
    ("delta_of_another_job", "job_identity", forge_delta_of_another_job),
    ("fingerprint", "redo_fingerprint", forge_fingerprint),  # resume only: the redo computes it
]


def test_the_controllers_delta_passes_verify_with_its_base(made: tuple[Path, Path, str], runs: Runs) -> None:
    job, store, _ = made
    out = verify(job, _copy(store, runs.base / "delta-untouched"))
    assert out.returncode == 0, out.stderr
    checks = json.loads(out.stdout)["checks"]
    assert {"redo_steps", "redo_rows", "redo_audit", "delta_base"} <= set(checks)
    assert "redo_fingerprint" not in checks


@pytest.mark.parametrize(("what", "check", "forge"), FORGERIES, ids=[w for w, _, _ in FORGERIES])
def test_a_forged_delta_is_refused_by_name_and_nothing_trains(
    what: str, check: str, forge: Callable[[CutSurgery], None], made: tuple[Path, Path, str], runs: Runs
) -> None:
    job, store, cut_id = made
    root = _copy(store, runs.base / f"delta-forged-{what}")
    forge(CutSurgery(root / "cuts" / cut_id))
    before = audit(root, "--all")

    out = verify(job, root)
    if check == "redo_fingerprint":
        assert out.returncode == 0, "verify trains nothing; the resume's redo runs this check"
    else:
        assert out.returncode == 1, out.stdout + out.stderr
        assert json.loads(out.stdout)["check"] == check, out.stdout

    rc, log = runs.run(job, root, "--resume", "auto", timeout=180)
    assert rc == 3, log
    assert f"[{check}]" in log, log
    assert audit(root, "--all") == before, "a refused resume trains nothing"


@pytest.mark.s3
def test_auto_cuts_a_delta_when_a_full_cut_would_not_fit_the_notice(
    runs: Runs, baseline: list[tuple[int, list[int]]], s3_bucket: Any, fault_proxy: Any, tmp_path: Path
) -> None:
    """``barrier: auto`` (the default) on a store where the trainer's files are slow (every PUT under
    ``trainer/`` held 3 s): a full cut is estimated over 80% of a 3 s SIGTERM deadline, so the
    barrier cuts a delta, which commits in time; the resume redoes its steps and trains the
    baseline."""
    fault_proxy.add("stall", method="PUT", key="/trainer/", seconds=3.0)
    # A full cut every 4 steps (and one at step 0 for the deltas to extend), a delta after every
    # step between them; generation held before step 7, so the delta of step 7 is the last cut
    # in flight: the barrier finds the writer idle (one writes at a time).
    job = runs.job({"checkpoint.everySteps": 4})
    uri = f"s3://{s3_bucket.bucket}/auto"
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {**s3_bucket.env(), "AWS_ENDPOINT_URL_S3": fault_proxy.endpoint}
    points = {"SPOTRL_FAILPOINTS": "dispatch.finish@7=60", "SPOTRL_FAILPOINT_DIR": str(marks)}
    proc = runs.start(job, uri, "--sigterm-deadline", "3", **points, **env)
    wait_for(lambda: (marks / "dispatch.finish").exists(), 300, "generation for step 7", proc)
    wait_for(lambda: "committed (periodic full, step 4" in runs.log_of(proc), 120, "the full cut of step 4", proc)
    # The delta after step 6 is the last cut before the hold: then the writer is idle.
    wait_for(lambda: "committed (periodic delta, step 7" in runs.log_of(proc), 120, "the delta of step 7", proc)
    assert stop(proc, signal.SIGTERM) == 143, runs.log_of(proc)
    log = runs.log_of(proc)
    assert "barrier cut: delta (a full cut is estimated at" in log, log
    store = s3_bucket.storage("auto")
    cut_id = newest_committed(store)
    assert cut_id is not None
    assert f"barrier cut {cut_id} committed at step" in log, log
    manifest = json.loads(store.get_bytes(f"cuts/{cut_id}/manifest.json"))
    assert (manifest["kind"], manifest["form"], manifest["base"]["trainer_step"]) == ("barrier", "delta", 4), manifest

    rc, log = runs.run(job, uri, **env)
    assert rc == 0, log
    assert f"of delta cut {cut_id}" in log, log
    assert stream_of(store) == baseline
    assert_same_trainer_state(store, runs.base / "baseline")


def test_cuts_by_the_clock_full_ones_at_a_step_boundary_and_deltas_while_a_step_waits(
    runs: Runs, baseline: list[tuple[int, list[int]]], tmp_path: Path
) -> None:
    """``everySeconds`` and ``deltaEverySeconds``, no step cadence: a group of step 2 is held 8 s
    in generation, so the trainer waits that long for the step. Deltas come every second of the
    wait until the full cut falls due (6 s after the first one: the wait begins two steps after
    it, a few seconds as the machine's load has it; step 5 was too late on a loaded machine, where
    each step also waits for its clock delta's write); that full cut is taken once the step's
    groups are ready, on the same step boundary; and the run is the uninterrupted one, with its
    weights."""
    clock = {
        "checkpoint.everySteps": 0,
        "checkpoint.everySeconds": 6,
        "checkpoint.deltaEverySteps": 0,
        "checkpoint.deltaEverySeconds": 1,
        "checkpoint.keep": 100,
    }
    store = tmp_path / "clock"
    rc, log = runs.run(runs.job(clock), store, SPOTRL_FAILPOINTS="dispatch.finish@2=8")
    assert rc == 0, log
    cuts = [CutSurgery(p).m for p in sorted((store / "cuts").iterdir()) if (p / "manifest.json").exists()]
    made = [(m["form"], m["trainer_step"], m["extra"]["reason"]) for m in cuts]
    assert made[0] == ("full", 0, "a full cut for the delta cuts to extend"), made
    assert made[-1] == ("full", 16, "final"), made
    by_clock = [c for c in made[1:-1] if c[0] == "full"]
    assert by_clock, f"no full cut by the clock: {made}"
    assert all(reason == "every 6 s" for _, _, reason in by_clock), made
    # Deltas every second of the wait, until the full cut falls due (it holds them all).
    waiting = [c for c in made if c[0] == "delta" and c[1] == 2]
    assert waiting, f"deltas while the trainer waits for step 2: {made}"
    assert all(reason == "every 1 s, delta" for _, _, reason in waiting), made
    assert stream(store) == baseline
    assert_same_trainer_state(store, runs.base / "baseline")


def test_a_step_commits_only_once_the_cut_of_the_step_before_it_has(
    runs: Runs, baseline: list[tuple[int, list[int]]], tmp_path: Path
) -> None:
    """The cut writer held before the manifest of the delta after step 5 (a slow store): step 6
    trains but does not commit (no audit record, no cut captured after it) while that cut is
    unwritten, so a loss then costs step 6 in progress and step 5 at most. Released, the run
    goes on; step 6's record says how long it waited, and the run is the uninterrupted one."""
    store, marks = tmp_path / "held", tmp_path / "marks"
    marks.mkdir()
    # cut.periodic@7: step 6 committed and audited (a mark only, no hold).
    points = {"SPOTRL_FAILPOINTS": "cut.files_written@6=300,cut.periodic@7=0", "SPOTRL_FAILPOINT_DIR": str(marks)}
    proc = runs.start(runs.job(), store, **points)
    try:
        wait_for(lambda: (marks / "cut.files_written").exists(), 300, "the cut of step 5 to be held", proc)
        # Absence over a window: unfixed, the tiny job's step 6 commits within it (its steps take
        # well under a second); fixed, it never does while the cut is held, however long.
        held_for = 5.0
        deadline = time.monotonic() + held_for
        while time.monotonic() < deadline:
            assert not (marks / "cut.periodic").exists(), "step 6 committed while the cut of step 5 was unwritten"
            assert proc.poll() is None, runs.log_of(proc)
            time.sleep(0.1)
        assert newest_cut(store)[2] == 5, "the delta of step 4 is the newest committed cut"
        (marks / "cut.files_written.release").touch()
        assert proc.wait(timeout=300) == 0, runs.log_of(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    waits = {d["step"]: d["cut_wait_seconds"] for d in AuditStore(open_storage(str(store))).documents()}
    assert waits[6] >= held_for - 3, waits  # step 6 trained in the first seconds of the hold
    assert "step 6 waited" in runs.log_of(proc)
    assert stream(store) == baseline
