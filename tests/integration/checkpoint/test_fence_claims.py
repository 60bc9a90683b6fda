"""The fence on a local store: claims are create-only, a newer claim fences older controllers,
and a fenced writer commits no cut (checked again just before the manifest)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cut_scenarios import example_b_before_cut

from spotrl_runtime.checkpoint import CutRequest
from spotrl_runtime.checkpoint.fence import Fence, FencedError, claimed_attempts
from spotrl_runtime.checkpoint.layout import list_cut_folders
from spotrl_runtime.storage import LocalStorage


def test_an_attempt_is_claimed_once_and_a_newer_claim_fences_the_older(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    old = Fence(store, 2).claim()
    with pytest.raises(FencedError, match=r"attempt 2 .* is claimed already"):
        Fence(store, 2).claim()
    old.check()  # nobody newer yet
    Fence(store, 3).claim()
    assert claimed_attempts(store) == [2, 3]
    with pytest.raises(FencedError, match="fenced: controller attempt 3 claimed"):
        old.check()
    with pytest.raises(FencedError, match="fenced"):
        Fence(store, 1).claim()  # a late starter with an old number never starts


def test_a_fenced_writer_commits_nothing_even_when_fenced_mid_cut(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path / "job")
    run = example_b_before_cut(store)
    assert run.writer is not None
    run.writer.fence = Fence(store, 0).claim()
    first = run.cut()

    def newer_claims_while_files_are_written(phase: str, step: int) -> None:
        if phase == "files_written":
            Fence(store, 1).claim()

    run.writer.progress = newer_claims_while_files_are_written
    with pytest.raises(FencedError):
        run.writer.write(run.owners, CutRequest.periodic(), run.state_fn)
    folders = list_cut_folders(store)
    assert [f.cut_id for f in folders if f.committed] == [first.cut_id]
    assert all(f.committed for f in folders), "the fenced writer's files are gone too"
    with pytest.raises(FencedError):
        run.cut()
