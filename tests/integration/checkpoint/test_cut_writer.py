"""The cut writer: commit protocol, crash before the manifest, concurrent writers, deadlines,
retention, the pointer, and that the ownership lock is not held while files are written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from cut_scenarios import DATASET, EXAMPLE_B, Run, example_b_before_cut, loader_for, rollout

from spotrl_runtime.api.times import Deadline
from spotrl_runtime.checkpoint import (
    BarrierDeadlineMissedError,
    CutConflictError,
    CutRequest,
    CutWriter,
    list_cut_folders,
    newest_committed,
    read_pointer,
    restore_cut,
    snapshot_trainer,
)
from spotrl_runtime.cli import main as spotrl
from spotrl_runtime.core.validation import ManifestMissingError
from spotrl_runtime.data import PromptCollate
from spotrl_runtime.storage import LocalStorage, Storage, open_storage

SCRIPT = Path(__file__).with_name("cut_scenarios.py")


def crash_between_files_and_manifest(storage: Storage, uri: str, env: dict[str, str] | None = None) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "crash-b", uri],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 137, proc.stderr
    committed = json.loads(proc.stdout.splitlines()[0])["committed"]
    folders = list_cut_folders(storage)
    assert [(f.cut_id, f.committed) for f in folders] == [(committed, True), ("0000000002", False)]
    assert len(folders[1].keys) >= 8, "the torn cut's files were written"
    assert newest_committed(storage) == committed
    assert read_pointer(storage)["cut_id"] == committed  # type: ignore[index]
    # The torn cut does not exist: restore takes the committed one; verify names the check.
    restored = restore_cut(storage, dataset=DATASET, collate=PromptCollate(), source=loader_for(EXAMPLE_B, DATASET))
    assert restored.cut_id == committed
    with pytest.raises(ManifestMissingError):
        restore_cut(
            storage,
            dataset=DATASET,
            collate=PromptCollate(),
            source=loader_for(EXAMPLE_B, DATASET),
            cut_id="0000000002",
        )
    assert spotrl(["ckpt", "verify", f"{uri}/cuts/0000000002"]) == 1
    # The next cut reuses the torn id with a fresh writer folder and removes the dead
    # writer's files once its own manifest is committed.
    run = Run.restore(EXAMPLE_B, DATASET, storage)
    cut = run.cut()
    assert cut.cut_id == "0000000002"
    writers = {k.split("/")[2] for k in list_cut_folders(storage)[1].keys if not k.endswith("manifest.json")}
    assert writers == {cut.manifest.writer}
    assert spotrl(["ckpt", "verify", f"{uri}/cuts/0000000002"]) == 0


@pytest.mark.slow
def test_crash_between_files_and_manifest_local(tmp_path: Path) -> None:
    crash_between_files_and_manifest(LocalStorage(tmp_path), str(tmp_path))


@pytest.mark.slow
@pytest.mark.s3
def test_crash_between_files_and_manifest_s3(s3_bucket: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in s3_bucket.env().items():
        monkeypatch.setenv(k, v)
    uri = f"s3://{s3_bucket.bucket}/jobs/crash"
    crash_between_files_and_manifest(open_storage(uri), uri, s3_bucket.env())


def concurrent_writers(storage: Storage) -> None:
    """Two controllers (split brain) cut the same job at once: the manifest's create-only write
    lets exactly one commit; the other stops with CutConflictError and leaves nothing behind."""
    runs = [example_b_before_cut(storage), example_b_before_cut(storage)]
    runs[1].finish("g3")  # the second controller's state differs, so we can tell the winner
    # Both capture before either lists the cut ids, and both write their files before
    # either writes its manifest: the worst interleaving.
    barriers = {"captured": threading.Barrier(2), "files_written": threading.Barrier(2)}

    def rendezvous(phase: str, step: int) -> None:
        if phase in barriers:
            barriers[phase].wait(10)

    for run in runs:
        assert run.writer is not None
        run.writer.progress = rendezvous
    outcome: dict[int, Any] = {}

    def cut(n: int) -> None:
        try:
            outcome[n] = runs[n].cut()
        except CutConflictError as err:
            outcome[n] = err

    threads = [threading.Thread(target=cut, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [n for n, o in outcome.items() if not isinstance(o, Exception)]
    losers = [n for n, o in outcome.items() if isinstance(o, CutConflictError)]
    assert len(winners) == 1
    assert len(losers) == 1
    assert "committed by another writer" in str(outcome[losers[0]])
    (folder,) = list_cut_folders(storage)
    won = outcome[winners[0]]
    assert folder.cut_id == won.cut_id
    assert {k.split("/")[2] for k in folder.keys if not k.endswith("manifest.json")} == {won.manifest.writer}, (
        "the loser removed its files"
    )
    restored = restore_cut(storage, dataset=DATASET, collate=PromptCollate(), source=loader_for(EXAMPLE_B, DATASET))
    in_flight = [r.group_id for r in restored.owners.capture().ledger if r.target_step is not None]
    assert in_flight == ([] if winners[0] == 1 else ["g3"])


def test_concurrent_second_writer_local(tmp_path: Path) -> None:
    concurrent_writers(LocalStorage(tmp_path))


@pytest.mark.s3
def test_concurrent_second_writer_s3(s3_bucket: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in s3_bucket.env().items():
        monkeypatch.setenv(k, v)
    concurrent_writers(open_storage(f"s3://{s3_bucket.bucket}/jobs/split-brain"))


def test_a_stale_controller_is_fenced_off(tmp_path: Path) -> None:
    """After a newer controller (a higher attempt) commits a cut, the old one may not cut again."""
    storage = LocalStorage(tmp_path)
    old = example_b_before_cut(storage)
    old.cut()
    new = Run.restore(EXAMPLE_B, DATASET, storage)
    assert new.owners.attempt == 1
    new.cut()
    with pytest.raises(CutConflictError, match="attempt 1, this one is attempt 0"):
        old.cut()
    assert [f.cut_id for f in list_cut_folders(storage)] == ["0000000001", "0000000002"]


def test_retention_keeps_the_newest_k_and_the_pointer_follows(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    run = example_b_before_cut(storage)
    ids = []
    for _ in range(5):
        ids.append(run.cut().cut_id)
        assert read_pointer(storage)["cut_id"] == ids[-1]  # type: ignore[index]
    assert [f.cut_id for f in list_cut_folders(storage)] == ids[-3:]
    assert not (tmp_path / "cuts" / ids[0]).exists(), "old cuts leave no empty folders behind"


def test_retention_keeps_a_base_and_its_deltas_as_one_cut_and_drops_them_together(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    run = Run.new(EXAMPLE_B, DATASET, storage)
    run.writer.keep = 1  # type: ignore[union-attr]
    run.drain(1)
    base = run.cut().cut_id
    run.drain(2)
    delta = run.cut("delta")
    assert delta.manifest.base is not None
    assert delta.manifest.base.cut_id == base
    assert [f.cut_id for f in list_cut_folders(storage)] == [base, delta.cut_id], "keep 1, but the delta needs its base"
    run.drain(3)
    second = run.cut("delta")  # a delta on the same base: one chain, all of it kept
    assert [f.cut_id for f in list_cut_folders(storage)] == [base, delta.cut_id, second.cut_id]
    full = run.cut()
    assert [f.cut_id for f in list_cut_folders(storage)] == [full.cut_id], "the old chain goes as one"
    assert not (tmp_path / "cuts" / base).exists()


def test_barrier_past_its_deadline_commits_nothing(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    run = example_b_before_cut(storage)
    assert run.writer is not None
    first = run.cut()
    with pytest.raises(BarrierDeadlineMissedError, match="not committed"):
        run.writer.write(run.owners, CutRequest.barrier(Deadline.after(0.0)), run.state_fn)
    assert [(f.cut_id, f.committed) for f in list_cut_folders(storage)] == [(first.cut_id, True)]
    assert read_pointer(storage)["cut_id"] == first.cut_id  # type: ignore[index]


@pytest.mark.alone
def test_the_lock_is_released_before_files_are_written(tmp_path: Path) -> None:
    """Generation results keep flowing while a cut writes its (big) files."""
    storage = LocalStorage(tmp_path)
    run = example_b_before_cut(storage)
    big = torch.nn.Linear(2048, 2048)  # 16 MiB of weights
    moved = threading.Event()
    in_files = threading.Event()

    def progress(phase: str, step: int) -> None:
        if phase == "captured":
            in_files.set()
            assert moved.wait(10), "an ownership move completed while the cut was writing its files"

    writer = CutWriter(storage, job="j", dataset={"uri": DATASET.uri, "size": len(DATASET)}, progress=progress)
    result: list[Any] = []
    t = threading.Thread(
        target=lambda: result.append(
            writer.write(
                run.owners,
                CutRequest.periodic(),
                lambda: snapshot_trainer(big.state_dict(), step=run.owners.trainer_step),
            )
        )
    )
    t.start()
    assert in_files.wait(10)
    t0 = time.perf_counter()
    d = run.inflight["g3"]
    run.owners.finish_group("g3", [rollout(d, i) for i in d.rollout_indexes])
    elapsed = time.perf_counter() - t0
    moved.set()
    t.join()
    assert elapsed < 0.5
    cut = result[0]
    assert cut.manifest.capture_seconds < 1.0
    assert cut.manifest.group_counts["admitted"] == 1, "the cut holds the state of its capture instant"
    weights = cut.manifest.file("weights")
    assert weights is not None
    assert weights.size > 16 * 1024 * 1024


@pytest.mark.s3
def test_big_weights_go_up_in_parallel_parts_and_come_back_exactly(s3_bucket: Any, tmp_path: Path) -> None:

    storage = s3_bucket.storage(
        "jobs/big",
        multipart_threshold=8 * 1024 * 1024,
        part_size=5 * 1024 * 1024,
        parallelism=4,
    )
    run = example_b_before_cut(storage)
    big = torch.nn.Linear(1536, 2048)  # 12 MiB of weights: three parts
    optimizer = torch.optim.AdamW(big.parameters())
    big(torch.randn(2, 1536)).sum().backward()
    optimizer.step()
    assert run.writer is not None
    cut = run.writer.write(
        run.owners,
        CutRequest.periodic(),
        lambda: snapshot_trainer(big.state_dict(), optimizer.state_dict(), step=run.owners.trainer_step),
    )
    weights = cut.manifest.file("weights")
    assert weights is not None
    assert weights.size > 12 * 1024 * 1024
    restored = restore_cut(
        storage,
        dataset=DATASET,
        collate=PromptCollate(),
        source=loader_for(EXAMPLE_B, DATASET),
        spool_dir=tmp_path,
    )
    assert restored.trainer is not None
    for name, tensor in big.state_dict().items():
        assert torch.equal(restored.trainer.weights[name], tensor)
    state = restored.trainer.optimizer
    assert state is not None
    assert torch.equal(state["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    assert list(tmp_path.iterdir()) == [], "downloaded copies are removed after the restore"


def test_steps_lost_with_the_controller_are_trained_again_on_the_same_prompts(tmp_path: Path) -> None:
    """After an abrupt loss the next attempt trains the steps after the last cut again; the
    effective stream (last attempt per step) equals what was trained the first time."""
    from spotrl_runtime.core.audit import effective_stream

    storage = LocalStorage(tmp_path)
    run = example_b_before_cut(storage)
    run.cut()
    run.drain(2)  # steps 0 and 1, then the controller is lost (no cut after them)
    again = Run.restore(EXAMPLE_B, DATASET, storage)
    again.drain(3)
    records = run.audit + again.audit
    assert [(r.step, r.attempt) for r in records] == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 1)]
    stream = effective_stream(records)
    assert {s: (r.attempt, r.idxs) for s, r in stream.items()} == {
        0: (1, (0, 2, 9)),
        1: (1, (6, 7, 8)),
        2: (1, (3, 10, 11)),
    }
    assert [r.idxs for r in run.audit] == [stream[0].idxs, stream[1].idxs], "retrained on the same prompts"


def test_start_or_restore_starts_fresh_then_restores(tmp_path: Path) -> None:
    from spotrl_runtime.checkpoint import RestoredRun, start_or_restore
    from spotrl_runtime.core.owners import Owners

    storage = LocalStorage(tmp_path)

    def start() -> Owners | RestoredRun:
        return start_or_restore(
            storage,
            config=EXAMPLE_B,
            dataset=DATASET,
            collate=PromptCollate(),
            source=loader_for(EXAMPLE_B, DATASET),
            expect_job="default/scenario",
        )

    fresh = start()
    assert isinstance(fresh, Owners)
    assert fresh.trainer_step == 0
    example_b_before_cut(storage).cut()
    restored = start()
    assert isinstance(restored, RestoredRun)
    assert restored.owners.counters.finished_found == 8


def test_a_barrier_that_cannot_capture_before_its_deadline_is_missed(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    run = example_b_before_cut(storage)
    assert run.writer is not None
    run.owners.begin_step()  # a long optimizer step is running
    with pytest.raises(BarrierDeadlineMissedError, match="step 0 was still training"):
        run.writer.write(run.owners, CutRequest.barrier(Deadline.after(0.1)), run.state_fn)
    run.owners.abort_step()
    assert list_cut_folders(storage) == []
