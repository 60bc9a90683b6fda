"""The controller stopped at many points, then resumed: it trains on exactly the prompts it
would have trained on had it never been stopped. Real torch, real Ray, real cuts on disk."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from controller_runs import (
    Runs,
    assert_admission_versions,
    assert_same_weights,
    audit,
    final_weights,
    newest_cut,
    stop,
    stream,
    wait_for,
)

from spotrl_runtime.checkpoint.layout import list_cut_folders, newest_committed
from spotrl_runtime.storage import open_storage

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("phase", "failpoint"),
    [
        ("mid-generation", "dispatch.finish@6=4"),
        ("mid-train-step", "train.step@6=4"),
        ("during-a-periodic-cut", "cut.files_written@4=4"),
    ],
)
def test_sigterm_takes_a_barrier_cut_and_resume_trains_the_same_prompts(
    runs: Runs, baseline: list[tuple[int, list[int]]], tmp_path: Path, phase: str, failpoint: str
) -> None:
    storage = tmp_path / "cuts"
    marks = tmp_path / "marks"
    marks.mkdir()
    job = runs.job()
    name = failpoint.split("=")[0].split("@")[0]
    proc = runs.start(job, storage, SPOTRL_FAILPOINTS=failpoint, SPOTRL_FAILPOINT_DIR=str(marks))
    wait_for(lambda: (marks / name).exists(), 300, f"the run to reach {name}", proc)
    trained_before = len(audit(storage, "--all"))
    rc = stop(proc, signal.SIGTERM)
    log = runs.log_of(proc)
    assert rc == 143, log
    assert "barrier cut" in log, log
    if phase == "mid-train-step":
        # The barrier did not wait for step 6: it stopped before its first micro-batch.
        assert "step 6 interrupted after 0 of" in log, log

    cut_id, kind, cut_step = newest_cut(storage)
    assert kind == "barrier"
    # Nothing trained is lost: the barrier cut holds every step this attempt trained.
    first = audit(storage, "--all")
    assert len(first) >= trained_before
    assert cut_step == len(first), (cut_step, [d["step"] for d in first])

    rc, log = runs.run(job, storage)
    assert rc == 0, log
    assert f"resumed from cut {cut_id} (barrier) at step {cut_step}" in log
    everything = audit(storage, "--all")
    retrained = [d["step"] for d in everything if d["attempt"] > 0 and d["step"] < cut_step]
    assert retrained == [], "a graceful preemption retrains nothing"
    assert stream(storage) == baseline


KILL_POINTS = {
    "inside a step": "train.step",
    "while a cut's files are written": "cut.files_written",
    "while older cuts are deleted": "cut.retention",
    "while a worker loads new weights": "worker.load_weights",
}
"""Where a SIGKILL lands (a failpoint holds the run there; its step: the trainer step, the cut's,
or the weights' version)."""


def newest_cut_after_a_kill(point: str, target: int, trained: int) -> tuple[int, int]:
    """The (lowest, highest) trainer step the newest committed cut may be at. A delta cut after
    every step: at most the step in progress is lost, and the one whose delta was still being
    written. While the cut writer is held, the trainer goes on (its cuts wait in line): a store
    that stalls costs the steps trained meanwhile."""
    if point == "cut.files_written":
        return target - 1, target - 1
    if point == "cut.retention":
        return target, target
    if point == "worker.load_weights":
        # No step in progress: the trainer trained on while the load was held, and the delta of
        # its last step, and on a loaded machine the one before, may still have been written.
        return trained - 2, trained
    return trained - 1, trained


def test_sigkill_at_random_points_costs_at_most_one_step_each_and_ends_with_the_uninterrupted_weights(
    runs: Runs, baseline: list[tuple[int, list[int]]], tmp_path: Path
) -> None:
    """Four kills without notice, one at each kind of point, at random steps in a random order
    (the seed is drawn per run and printed; SPOTRL_KILL_SEED replays it). Each resume starts from
    the newest per-step delta (or full) cut."""
    seed = int(os.environ.get("SPOTRL_KILL_SEED") or random.SystemRandom().randrange(1 << 30))
    print(f"SPOTRL_KILL_SEED={seed}")
    rng = random.Random(seed)
    storage = tmp_path / "cuts"
    job = runs.job()
    points = rng.sample(sorted(KILL_POINTS.items()), len(KILL_POINTS))
    targets = sorted(rng.sample(range(2, 14), len(points)))
    kills, lost = 0, 0
    for i, ((where, point), target) in enumerate(zip(points, targets, strict=True)):
        marks = tmp_path / f"marks-{i}"
        marks.mkdir()
        hold = f"{point}@{target}=30"
        proc = runs.start(job, storage, SPOTRL_FAILPOINTS=hold, SPOTRL_FAILPOINT_DIR=str(marks))
        wait_for(lambda m=marks, p=point: (m / p).exists(), 300, f"{where} at step {target} (seed {seed})", proc)  # type: ignore[misc]
        time.sleep(rng.uniform(0, 0.3))
        assert stop(proc, signal.SIGKILL) == -signal.SIGKILL
        kills += 1
        # Ray's processes, in sessions of their own, still die with the controller.
        runs.assert_nothing_left(proc)
        _, kind, cut_step = newest_cut(storage)
        assert kind == "periodic"
        # What this attempt (the i-th) trained: the steps it audited at or past the cut the next
        # one resumes from are trained again, once each.
        mine = [d["step"] for d in audit(storage, "--all") if d["attempt"] == i]
        trained = max(mine) + 1 if mine else cut_step
        low, high = newest_cut_after_a_kill(point, target, trained)
        why = f"killed {where} at step {target}: newest cut at step {cut_step}, {trained} trained (seed {seed})"
        assert low <= cut_step <= high, why
        lost += sum(1 for step in mine if step >= cut_step)
    rc, log = runs.run(job, storage)
    assert rc == 0, log
    assert stream(storage) == baseline
    assert_admission_versions(storage)
    assert_same_weights(final_weights(storage), final_weights(runs.base / "baseline"))
    everything = audit(storage, "--all")
    attempts = {d["attempt"] for d in everything}
    assert attempts <= set(range(kills + 1)), attempts
    # Steps after the last cut before a kill were trained again by a later attempt, on the same prompts.
    by_step: dict[int, list[dict]] = {}
    for d in everything:
        by_step.setdefault(d["step"], []).append(d)
    again = {s: ds for s, ds in by_step.items() if len(ds) > 1}
    for ds in again.values():
        assert len({tuple(d["prompts"]) for d in ds}) == 1

    # The accounting says the same, from storage alone: nothing lost or trained twice, the
    # retrained steps counted, one restore and its seconds per kill.
    out = subprocess.run(
        [sys.executable, "-m", "spotrl_runtime.cli", "audit", str(storage), "--summary", "--json"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["prompts_lost"] == 0
    assert summary["prompts_trained_twice"] == 0
    assert summary["steps_missing"] == 0
    assert summary["steps_retrained"] == sum(len(ds) - 1 for ds in again.values()) == lost, (summary, seed)
    assert summary["prompts_trained"] == sum(len(prompts) for _, prompts in baseline)
    assert summary["restores"] == kills
    assert len(summary["seconds_lost_per_preemption"]) == kills
    assert all(s >= 0 for s in summary["seconds_lost_per_preemption"])
    text = subprocess.run(
        [sys.executable, "-m", "spotrl_runtime.cli", "audit", str(storage), "--summary"], capture_output=True, text=True
    ).stdout
    assert f"stepsRetrained            {summary['steps_retrained']}" in text, text

    # TensorBoard shows each step once, the effective one: each attempt wrote a file of its own,
    # and a resumed one's purge marker hides the steps it trained again from the killed one's.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert len(list((storage / "tensorboard").glob("events.out.tfevents.*.attempt-*"))) == kills + 1
    events = EventAccumulator(str(storage / "tensorboard"))
    events.Reload()
    rewards = events.Scalars("reward/mean")
    assert [e.step for e in rewards] == [step for step, _ in baseline]
    effective = {d["step"]: d["reward"] for d in audit(storage)}
    assert [round(e.value, 5) for e in rewards] == [round(effective[e.step], 5) for e in rewards]
    assert {"response_length/mean", "actor/entropy", "actor/grad_norm", "reward/accuracy"} <= set(
        events.Tags()["scalars"]
    )


def test_a_dead_generation_worker_is_replaced_without_a_restore(
    runs: Runs, baseline: list[tuple[int, list[int]]], tmp_path: Path
) -> None:
    storage = tmp_path / "cuts"
    marks = tmp_path / "marks"
    marks.mkdir()
    summary = tmp_path / "summary.json"
    job = runs.job({"generation.workers": 2})
    proc = runs.start(
        job,
        storage,
        "--summary-json",
        str(summary),
        # Each worker holds the first batch it gets on weights of step 5 or later: the one
        # killed certainly holds groups (an idle one would lose nothing to redispatch).
        SPOTRL_FAILPOINTS="worker.generate@5+=300",
        SPOTRL_FAILPOINT_DIR=str(marks),
    )
    wait_for(lambda: (marks / "worker.generate").exists(), 300, "a worker holding a batch of step 5", proc)
    holder = json.loads((marks / "worker.generate").read_text())["pid"]
    workers = subprocess.run(["pgrep", "-f", "GenerationWorker"], capture_output=True, text=True).stdout.split()
    mine = [int(pid) for pid in workers if _is_descendant(int(pid), proc.pid)]
    assert len(mine) == 2, (workers, mine)
    assert holder in mine, (holder, mine)
    subprocess.run(["kill", "-9", str(holder)], check=True)
    (marks / "worker.generate.release").touch()  # the other worker, and the restarted one, go on
    rc = proc.wait(timeout=300)
    log = runs.log_of(proc)
    assert rc == 0, log
    s = json.loads(summary.read_text())
    assert s["resumed_from"] is None
    assert s["stats"]["groups_lost_redispatched"] >= 1, s["stats"]
    assert {d["attempt"] for d in audit(storage, "--all")} == {0}
    assert stream(storage) == baseline
    # A lost group is generated again with its admission weights while they are still on the
    # workers, else with the current ones; either way the steps count exactly what happened.
    from spotrl_runtime.controller.audit_store import AuditStore

    counted = sum(d["version_mismatches"] for d in AuditStore(open_storage(str(storage))).documents())
    assert counted == s["stats"]["version_mismatches"] <= s["stats"]["groups_lost_redispatched"], s["stats"]


def _is_descendant(pid: int, ancestor: int) -> bool:
    seen = 0
    while pid > 1 and seen < 64:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        seen += 1
    return False


def test_a_corrupted_cut_asked_for_by_name_stops_resume_with_the_named_check(runs: Runs, tmp_path: Path) -> None:
    """One flipped bit in a cut's ledger on disk: asked for by name, the cut is refused as
    [file_digest] naming the file, and the refused run stops the Ray it started. (A cut of
    another job is refused as [job_identity], with its store unchanged: test_fence.py.)"""
    storage = tmp_path / "cuts"
    job = runs.job({"training.totalSteps": 4, "checkpoint.everySteps": 2})
    rc, log = runs.run(job, storage)
    assert rc == 0, log

    store = open_storage(str(storage))
    cut_id = newest_committed(store)
    assert cut_id is not None
    folder = next(f for f in list_cut_folders(store) if f.cut_id == cut_id)
    victim = next(o.key for o in store.list(f"cuts/{cut_id}/") if o.key.endswith("ledger.json"))
    data = bytearray(store.get_bytes(victim))
    data[len(data) // 2] ^= 0x01
    (storage / victim).write_bytes(bytes(data))
    more = runs.job({"training.totalSteps": 6, "checkpoint.everySteps": 2})
    # `--resume auto` would skip it loudly: test_forged_cuts.py checks that.
    rays_before = set(runs.ray_tmp.glob("ray-*"))
    rc, log = runs.run(more, storage, "--resume", cut_id)
    assert rc == 3, log
    assert set(runs.ray_tmp.glob("ray-*")) <= rays_before, "the refused run stopped the Ray it had started"
    assert "[file_digest]" in log
    assert "sha256" in log
    assert victim.rsplit("/", 1)[-1] in log
    assert folder.cut_id == cut_id


def test_a_barrier_that_cannot_commit_in_time_says_so_and_exits_143(runs: Runs, tmp_path: Path) -> None:
    storage = tmp_path / "cuts"
    marks = tmp_path / "marks"
    marks.mkdir()
    job = runs.job()
    # The periodic cut at step 4 holds the cut writer for 8 s; the barrier behind it has 1 s.
    proc = runs.start(
        job,
        storage,
        "--sigterm-deadline",
        "1",
        SPOTRL_FAILPOINTS="cut.files_written=8",
        SPOTRL_FAILPOINT_DIR=str(marks),
    )
    wait_for(lambda: (marks / "cut.files_written").exists(), 300, "the periodic cut to stall", proc)
    rc = stop(proc, signal.SIGTERM)
    log = runs.log_of(proc)
    assert rc == 143, log
    assert "stopping without a barrier cut (the last committed cut stands)" in log
    assert "Traceback" not in log
    kinds = [json.loads((f / "manifest.json").read_text())["kind"] for f in sorted((storage / "cuts").iterdir())]
    assert "barrier" not in kinds
