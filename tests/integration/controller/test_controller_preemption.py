"""The controller stopped at many points, then resumed: it trains on exactly the prompts it
would have trained on had it never been stopped, and ends with the same weights and optimizer
state. Real torch, real Ray, real cuts on disk."""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from controller_runs import (
    Process,
    Runs,
    assert_admission_versions,
    assert_same_trainer_state,
    audit,
    kill_rng,
    newest_cut,
    spotrl,
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
    assert_same_trainer_state(storage, runs.base / "baseline")


KILL_POINTS = {
    "train.step": "inside a step",
    "cut.files_written": "while a cut's files are written",
    "cut.retention": "while older cuts are deleted",
    "worker.load_weights": "while a worker loads new weights",
}
"""Where a failpoint holds the run for a SIGKILL (its step: the trainer step, the cut's, or the
weights' version)."""

FAILPOINT_KILLS, RANDOM_KILLS = 2, 2
"""Kills held at points of :data:`KILL_POINTS` (which, drawn per run) and kills at random moments
with no failpoint: with the last, uninterrupted run, five runs in the chain, as when it killed at
the four points alone."""


def newest_cut_after_a_kill(point: str | None, target: int, trained: int) -> tuple[int, int]:
    """The (lowest, highest) trainer step the newest committed cut may be at after a kill that
    found ``trained`` steps trained; the steps lost, trained again, are ``trained`` less it. A
    delta cut follows every step; the full cut of every 4th step is captured once the next
    step's groups are ready. One writer writes them in turn while the trainer goes on.
    ``point``: a failpoint of :data:`KILL_POINTS` holding step ``target``; None: a random moment."""
    if point == "train.step":
        # At most one step lost: the one whose cut (the delta of step target-1, or the full cut
        # of step target, captured as its groups became ready) may still be being written.
        return trained - 1, trained
    if point == "worker.load_weights":
        # At most two: the trainer waits for the held load after step target; a 4th step's full
        # cut waits for the next step's groups, which wait for the load, and on a loaded machine
        # the delta of the step before may still be in the writer's line.
        return trained - 2, trained
    if point == "cut.files_written":
        # A bound on the cut, not on the loss: the held cut never commits, the one before it
        # stands. The steps the trainer trained while the writer was held are lost with it.
        return target - 1, target - 1
    if point == "cut.retention":
        # The held cut committed before its retention: a half-done deletion loses nothing of it.
        return target, target
    # At most two at a random moment: the step whose cut was in the writer's line, and the one
    # trained while it was written (a full cut, captured as the next step starts, can take
    # longer than a short step).
    return trained - 2, trained


STEP_LINE = re.compile(r"^\[\s*([\d.]+)s\] step\s+\d+/", re.M)
"""A trained step's progress line, and its seconds since the run started."""


def killed_at_a_random_moment(runs: Runs, job: Path, storage: Path, rng: random.Random, why: str) -> Process:
    """A run SIGKILLed at a random moment, no failpoint: after its second step line, a delay
    drawn uniformly over the time between its first two (their lines' clock), so that the kill
    lands anywhere in a step's cycle (generating, training, writing a cut, sending weights) and
    the run keeps steps for the kills after it."""
    proc = runs.start(job, storage)
    stamps: list[float] = []

    def two_steps() -> bool:
        stamps[:] = [float(t) for t in STEP_LINE.findall(runs.log_of(proc))]
        return len(stamps) >= 2

    wait_for(two_steps, 300, f"two steps ({why})", proc)
    time.sleep(rng.uniform(0, stamps[1] - stamps[0]))
    assert stop(proc, signal.SIGKILL) == -signal.SIGKILL
    return proc


def test_sigkill_at_points_and_random_moments_loses_what_each_allows_and_ends_with_the_uninterrupted_weights(
    runs: Runs, baseline: list[tuple[int, list[int]]], tmp_path: Path
) -> None:
    """Kills without notice, at failpoints of :data:`KILL_POINTS` (held 30 s, killed 0-0.3 s in) and
    at random moments without one (:data:`FAILPOINT_KILLS`, :data:`RANDOM_KILLS`), in a random
    order, each a step or two past the cut the run resumed from (the seed is drawn per run and
    printed; SPOTRL_KILL_SEED replays it). Each loses at most what
    :func:`newest_cut_after_a_kill` says (one step inside a step, two at a random moment or a
    held weight load; at a cut-writer point, the steps the trainer trained while the writer was
    held), and the next run resumes from the newest committed cut. The last run ends with the
    uninterrupted run's stream, weights and optimizer state."""
    seed, rng = kill_rng()
    storage = tmp_path / "cuts"
    job = runs.job()
    kinds: list[str | None] = [*rng.sample(sorted(KILL_POINTS), FAILPOINT_KILLS), *[None] * RANDOM_KILLS]
    rng.shuffle(kinds)
    kills, lost, resumed_at, cut_id = 0, 0, 0, None
    audited: set[tuple[int, int]] = set()  # (step, attempt)
    for i, point in enumerate(kinds):
        target = min(max(2, resumed_at + rng.randint(1, 2)), 14)
        where = f"{KILL_POINTS[point]} at step {target}" if point else "at a random moment"
        why = f"kill {i}, {where} (seed {seed})"
        assert target > resumed_at, f"no step left for {why}"
        if point is None:
            proc = killed_at_a_random_moment(runs, job, storage, rng, why)
        else:
            marks = tmp_path / f"marks-{i}"
            marks.mkdir()
            hold = f"{point}@{target}=30"
            proc = runs.start(job, storage, SPOTRL_FAILPOINTS=hold, SPOTRL_FAILPOINT_DIR=str(marks))
            wait_for(lambda m=marks, p=point: (m / p).exists(), 300, why, proc)  # type: ignore[misc]
            time.sleep(rng.uniform(0, 0.3))
            assert stop(proc, signal.SIGKILL) == -signal.SIGKILL
        kills += 1
        # Ray's processes, in sessions of their own, still die with the controller.
        runs.assert_nothing_left(proc)
        if cut_id is not None:
            assert f"resumed from cut {cut_id} " in runs.log_of(proc), f"{why}: not from the newest cut"
        cut_id, kind, cut_step = newest_cut(storage)
        assert kind == "periodic"
        # What this attempt trained: the steps it audited at or past the cut the next one
        # resumes from are trained again, once each.
        before, audited = audited, {(d["step"], d["attempt"]) for d in audit(storage, "--all")}
        mine = [step for step, _ in audited - before]
        trained = max(mine) + 1 if mine else resumed_at
        if point == "train.step":
            assert trained == target, why
        low, high = newest_cut_after_a_kill(point, target, trained)
        print(f"{why}: newest cut at step {cut_step}, {trained} trained")
        assert low <= cut_step <= high, f"{why}: newest cut at step {cut_step}, {trained} trained"
        lost += sum(1 for step in mine if step >= cut_step)
        resumed_at = cut_step
    rc, log = runs.run(job, storage)
    assert rc == 0, log
    assert f"resumed from cut {cut_id} " in log, log
    assert stream(storage) == baseline
    assert_admission_versions(storage)
    assert_same_trainer_state(storage, runs.base / "baseline")
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
    out = spotrl("audit", str(storage), "--summary", "--json")
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
    text = spotrl("audit", str(storage), "--summary").stdout
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
    mine = [pid for pid in runs.processes_of(proc) if "GenerationWorker" in _cmdline(pid)]
    assert len(mine) == 2, mine
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

    docs = AuditStore(open_storage(str(storage))).documents()
    counted = sum(d["version_mismatches"] for d in docs)
    assert counted == s["stats"]["version_mismatches"] <= s["stats"]["groups_lost_redispatched"], s["stats"]
    # Each step says how idle the two workers were, the mean and the idlest; one worker held its
    # batch five minutes (the failpoint) and was killed: the step that waited for it reports
    # the survivor's idling beside it, and the dead one's restart.
    shares = [(d["generation_idle_share"], d["generation_idle_share_max"]) for d in docs]
    assert all(0 <= mean <= most <= 1 for mean, most in shares), shares
    assert any(mean < most for mean, most in shares), shares
    assert_same_trainer_state(storage, runs.base / "baseline")  # unless a group was counted above


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


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
