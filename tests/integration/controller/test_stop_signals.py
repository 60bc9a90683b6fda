"""Ctrl-C (SIGINT) and SIGTERM, sent to `spotrl run`'s pid or to its whole process group (a
terminal's Ctrl-C, ``kill -- -PGID``): the barrier cut commits while Ray, the generation
workers and the trainer ranks are alive, the run exits 130 or 143 and leaves nothing running,
and the same command resumes from the cut, training the uninterrupted run's prompts with
nothing retrained. A second Ctrl-C only warns; a third stops at once, without the cut.

The signal comes in step 4, before the first periodic cut (everySteps 4): without a barrier
cut the next run would start again at step 1."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from controller_runs import Process, Runs, audit, fsdp, newest_cut, stop, stream, wait_for

from spotrl_e2e.procs import process_state
from spotrl_runtime.checkpoint.layout import list_cut_folders, manifest_key
from spotrl_runtime.storage import open_storage

pytestmark = pytest.mark.slow


RAY_PARTS = ("gcs_server", "raylet/raylet", "ray::GenerationWorker", "ray::TrainerRank")


def ray_processes(runs: Runs, proc: Process) -> dict[int, str]:
    """Every process of the run but the controller (pid: command line), less Ray's idle
    workers, which Ray starts and ends as it likes: its GCS, raylet, monitors and agents, the
    generation workers, the trainer ranks."""
    out = {}
    for pid in runs.processes_of(proc):
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if not cmd.startswith("ray::IDLE"):
                out[pid] = cmd[:100]
    return out


def alive(pid: int) -> bool:
    state = process_state(pid)
    return state is not None and state != "Z"


def send(proc: Process, sig: int, to: str) -> None:
    """``sig`` to the run's pid, or to its process group (it leads one: ``new_session``)."""
    if to == "group":
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)


@pytest.mark.parametrize(
    ("strategy", "sig", "to", "dtype"),
    [
        # Each signal, target and strategy at least once. That a signal to the group reaches
        # the controller alone is one mechanism for either signal (Ray's processes in sessions
        # of their own): proven with ranks and without. SIGTERM to the pid is the kubelet's
        # stop, which the controller preemption tests send. Once in the users' dtype: bf16
        # compute over float32 masters, bf16 generation; the stream is the fp32 baseline's
        # (the prompts a step trains do not depend on the weights).
        pytest.param("single", signal.SIGINT, "pid", "float32", id="single-SIGINT-pid"),
        pytest.param("single", signal.SIGINT, "group", "float32", id="single-SIGINT-group"),
        pytest.param("fsdp", signal.SIGTERM, "group", "float32", id="fsdp-SIGTERM-group"),
        pytest.param("single", signal.SIGTERM, "pid", "bfloat16", id="single-SIGTERM-pid-bf16"),
    ],
)
def test_a_stop_signal_commits_a_barrier_cut_and_the_resume_trains_the_baseline(
    runs: Runs, baseline: list[tuple[int, list[int]]], tmp_path: Path, strategy: str, sig: int, to: str, dtype: str
) -> None:
    storage, marks = tmp_path / "cuts", tmp_path / "marks"
    marks.mkdir()
    name = signal.Signals(sig).name
    job = runs.job({**(fsdp(2) if strategy == "fsdp" else {}), "policy.dtype": dtype})
    # Held in step 4, and the barrier's cut once captured, so that the test sees who is alive then.
    env = {"SPOTRL_FAILPOINTS": "train.step@3=3,cut.captured=60", "SPOTRL_FAILPOINT_DIR": str(marks)}
    proc = runs.start(job, storage, new_session=True, **env)
    wait_for(lambda: (marks / "train.step").exists(), 300, "step 4", proc)
    trained_before = len(audit(storage, "--all"))
    ray = ray_processes(runs, proc)
    wanted = RAY_PARTS[: 4 if strategy == "fsdp" else 3]
    assert [part for part in wanted if not any(part in cmd for cmd in ray.values())] == [], ray
    sent = time.monotonic()
    send(proc, sig, to)
    wait_for(lambda: (marks / "cut.captured").exists(), 60, "the barrier's capture", proc)
    assert {pid: cmd for pid, cmd in ray.items() if not alive(pid)} == {}, "all of Ray lives on to the cut"
    (marks / "cut.captured.release").touch()
    rc = proc.wait(timeout=90)
    seconds = time.monotonic() - sent
    log = runs.log_of(proc)
    committed = re.search(rf"barrier cut \S+ committed at step \d+ in ([\d.]+) s \({name}\)", log)
    assert committed is not None, log
    assert rc == 128 + sig, log
    assert f"spotrl: {name}: taking a barrier cut, then stopping (exit {128 + sig})" in log, log
    assert "GCS may have been killed" not in log, log
    assert "trainer rank was lost" not in log, log
    print(f"{strategy} {name} to the {to}: cut in {committed.group(1)} s, exit {seconds:.1f} s after the signal")
    runs.assert_nothing_left(proc)

    cut_id, kind, cut_step = newest_cut(storage)
    assert kind == "barrier"
    if dtype == "bfloat16":
        import torch

        parts = sorted(storage.glob(f"cuts/{cut_id}/*/trainer/weights*.pt"))
        assert parts, sorted(p.name for p in storage.glob(f"cuts/{cut_id}/*/trainer/*"))
        weights = {k: v for part in parts for k, v in torch.load(part, weights_only=True).items()}
        assert {v.dtype for v in weights.values()} == {torch.float32}, "a bf16 job's cut holds its float32 masters"
    first = audit(storage, "--all")
    # The single process's barrier interrupts step 4; the ranks finish it, and the cut holds it.
    assert trained_before == 3
    assert cut_step == len(first) == (4 if strategy == "fsdp" else 3), (cut_step, [d["step"] for d in first])

    until = cut_step + 2
    rc, log = runs.run(job, storage, "--max-steps", str(until))
    assert rc == 0, log
    assert f"resumed from cut {cut_id} (barrier) at step {cut_step}" in log, log
    retrained = [d["step"] for d in audit(storage, "--all") if d["attempt"] > 0 and d["step"] < cut_step]
    assert retrained == [], "a stop by a signal retrains nothing"
    assert stream(storage) == baseline[:until]


def test_a_second_ctrl_c_warns_and_a_third_stops_at_once_without_the_cut(runs: Runs, tmp_path: Path) -> None:
    """Ctrl-C in a terminal (SIGINT to the process group) while the barrier cut is held just
    after its capture: the second press only says how to abort, the third aborts. Exit 130,
    no barrier cut (its folder has no manifest, so nothing resumes from it), nothing running."""
    storage, marks = tmp_path / "cuts", tmp_path / "marks"
    marks.mkdir()
    env = {"SPOTRL_FAILPOINTS": "cut.captured=120", "SPOTRL_FAILPOINT_DIR": str(marks)}
    proc = runs.start(runs.job(), storage, new_session=True, **env)
    wait_for(lambda: re.search(r"step +2/", runs.log_of(proc)) is not None, 300, "step 2", proc)
    os.killpg(proc.pid, signal.SIGINT)
    wait_for(lambda: (marks / "cut.captured").exists(), 60, "the barrier's capture", proc)
    os.killpg(proc.pid, signal.SIGINT)
    warning = "spotrl: cutting, press Ctrl-C again to abort"
    wait_for(lambda: warning in runs.log_of(proc), 30, "the warning", proc)
    time.sleep(1.0)
    assert proc.poll() is None, "the second Ctrl-C does not stop the run"
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    rc = proc.wait(timeout=30)
    seconds = time.monotonic() - sent
    log = runs.log_of(proc)
    assert rc == 130, log
    assert "spotrl: aborted: stopping now without a barrier cut (the last committed cut stands; exit 130)" in log
    assert "Traceback" not in log, log
    print(f"the third Ctrl-C: exit {seconds:.2f} s after it")
    runs.assert_nothing_left(proc, timeout=10)

    store = open_storage(str(storage))
    kinds = [
        json.loads(store.get_bytes(manifest_key(f.cut_id)))["kind"] for f in list_cut_folders(store) if f.committed
    ]
    assert kinds, "the periodic cuts before the barrier stand"
    assert set(kinds) == {"periodic"}, f"no barrier cut exists: {kinds}"


def test_a_stop_signal_while_the_final_cut_is_written_exits_within_its_deadline(runs: Runs, tmp_path: Path) -> None:
    """Every step trained and the final cut's commit held: a SIGTERM takes no barrier then
    (nothing is left to train), but its deadline bounds the wait for the final cut as it bounds a
    barrier's, so the grace period never ends in the middle of a write. The last committed cut
    stands: the final one is not half there."""
    store = runs.base / "final-held"
    marks = tmp_path / "marks"
    marks.mkdir()
    held = {"SPOTRL_FAILPOINTS": "cut.files_written@16=300", "SPOTRL_FAILPOINT_DIR": str(marks)}
    proc = runs.start(runs.job(), store, "--sigterm-deadline", "3", **held)
    wait_for(lambda: (marks / "cut.files_written").exists(), 300, "the final cut's files", proc)
    signalled = time.monotonic()
    assert stop(proc, signal.SIGTERM, timeout=30) == 143, runs.log_of(proc)
    assert time.monotonic() - signalled < 3 + 10, "stopped within the deadline, with a margin for the shutdown"
    assert "the final cut did not commit within --sigterm-deadline" in runs.log_of(proc)
    _, kind, step = newest_cut(store)
    assert step < 16, (kind, step)
