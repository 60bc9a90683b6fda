"""The two worked examples of recovery.md, through the real path: drive the core to the
described state, cut to storage, restore in a fresh process, continue, check every stamp,
owner and counter the example names, and compare with the run that never stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cut_scenarios import A_LABELS, continue_a, continue_b, example_a_before_cut, example_b_before_cut

from spotrl_runtime.core.ledger import Phase
from spotrl_runtime.storage import LocalStorage, Storage, open_storage

SCRIPT = Path(__file__).with_name("cut_scenarios.py")

# Each test starts a fresh Python (torch import included) to restore in.
pytestmark = pytest.mark.slow


def resume_in_fresh_process(action: str, uri: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), action, uri],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def check_example_a(storage: Storage, uri: str, env: dict[str, str] | None = None) -> None:
    run = example_a_before_cut(storage)
    g20, g21, g22, g23 = (A_LABELS[k] for k in ("g20", "g21", "g22", "g23"))
    cut = run.cut("barrier")
    # What the cut holds: g20 finished (replay, stamp 7), g21 ADMITTED for 8 with 2 of 4
    # rollouts, g22 RESERVED, g23 still in the loader (next idx 10).
    snap = run.owners.capture()
    assert snap.trainer_step == 7
    assert snap.dispatch_index == 8
    assert [(e.group_id, e.target_step, len(e.group.rollouts)) for e in snap.replay] == [(g20, 7, 4)]
    assert [(r.group_id, r.phase, r.target_step) for r in snap.ledger] == [
        (g21, Phase.ADMITTED, 8),
        (g22, Phase.RESERVED, None),
    ]
    assert {g: [r.index for r in rows] for g, rows in snap.partial.items()} == {g21: [0, 1]}
    assert cut.manifest.group_counts["replay"] == 1
    assert cut.manifest.group_counts["partial_rows"] == 2

    resumed = resume_in_fresh_process("resume-a", uri, env)
    # g21 is relaunched for step 8 with its group_id; its 2 finished siblings are kept.
    assert resumed["first_pump"] == [[g21, 8, [2, 3], True]]
    # g20 trains at step 7 with no generation.
    assert resumed["step_7_ready_without_generation"] is True
    assert g20 not in resumed["regenerated"]
    # g22 is admitted again once the gate opens: stamp 9; g23 comes from the loader.
    assert resumed["after_step_7_pump"] == [[g22, 9, False]]
    assert resumed["reserved_after_step_7"] == [g23]
    assert resumed["group_ids"] == {"7": [g20], "8": [g21], "9": [g22], "10": [g23]}
    assert resumed["counters"] == {
        "groups_found": 2,
        "finished_found": 1,
        "groups_relaunched": 2,
        "groups_discarded": 0,
        "rollouts_reused": 2,
        "turns_found": 0,
        "prompts_dropped": 0,
        "prompts_filtered": 0,
        "borrows": 0,
        "replace_fallbacks": 0,
    }
    # Every prompt trains exactly once, and the run equals the one that never stopped.
    reference = example_a_before_cut(None)
    reference_result = continue_a(reference)
    assert resumed["stream"] == reference_result["stream"]
    trained_before = [r.idxs for r in run.audit]
    assert trained_before == [(i,) for i in range(7)]
    assert sorted([*(i for (i,) in trained_before), *(i for v in resumed["stream"].values() for i in v)]) == list(
        range(11)
    )
    assert resumed["weights"] == reference_result["weights"], "trainer state and RNG were restored exactly"


def check_example_b(storage: Storage, uri: str, env: dict[str, str] | None = None) -> None:
    run = example_b_before_cut(storage)
    snap = run.owners.capture()
    stamps: dict[int, list[int]] = {}
    for _order, step, idx in sorted(
        [(e.order, e.target_step, e.group.prompt.idx) for e in snap.replay]
        + [(r.order, r.target_step, r.idx) for r in snap.ledger if r.target_step is not None]
    ):
        stamps.setdefault(step, []).append(idx)
    assert dict(sorted(stamps.items())) == {0: [0, 2, 9], 1: [6, 7, 8], 2: [3, 10, 11]}
    cut = run.cut()
    # The cut: 8 finished groups, group 3 ADMITTED for step 2, 12-14 RESERVED, cursor 2, spares [4, 5].
    counts = cut.manifest.group_counts
    assert (counts["replay"], counts["admitted"], counts["reserved"], counts["spares"]) == (8, 1, 3, 2)
    assert cut.manifest.dispatch_index == 2
    assert [(r.idx, r.phase, r.target_step) for r in snap.ledger] == [
        (3, Phase.ADMITTED, 2),
        (12, Phase.RESERVED, None),
        (13, Phase.RESERVED, None),
        (14, Phase.RESERVED, None),
    ]
    assert [s.idx for s in snap.spares] == [4, 5]

    resumed = resume_in_fresh_process("resume-b", uri, env)
    assert resumed["first_pump"] == [["g3", 2, [0, 1], True]], "the ADMITTED spare goes first, for step 2"
    assert resumed["cursor"] == 2, "the saved cursor, not one rebuilt from the trainer step"
    assert resumed["trainer_step"] == 0
    # The reserved batch is stamped 3 (cursor + 1) once step 0 trains; nothing is discarded.
    assert resumed["after_step_0_pump"] == [["g12", 3, False], ["g13", 3, False], ["g14", 3, False]]
    assert resumed["stream"] == {"0": [0, 2, 9], "1": [6, 7, 8], "2": [3, 10, 11], "3": [12, 13, 14]}
    assert resumed["dropped"] == {"0": [1]}
    assert resumed["spares"] == [4, 5]
    assert resumed["counters"]["groups_found"] == 4
    assert resumed["counters"]["groups_relaunched"] == 4
    assert resumed["counters"]["finished_found"] == 8
    assert resumed["counters"]["groups_discarded"] == 0
    # Every prompt 0-14 is accounted for: trained, dropped on purpose, or still a spare.
    accounted = [i for v in resumed["stream"].values() for i in v] + [1] + resumed["spares"]
    assert sorted(accounted) == list(range(15))
    reference = continue_b(example_b_before_cut(None))
    assert resumed["stream"] == reference["stream"]
    assert resumed["weights"] == reference["weights"]


def test_example_a_local(tmp_path: Path) -> None:
    check_example_a(LocalStorage(tmp_path), str(tmp_path))


def test_example_b_local(tmp_path: Path) -> None:
    check_example_b(LocalStorage(tmp_path), str(tmp_path))


@pytest.mark.s3
def test_example_a_on_s3(s3_bucket: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in s3_bucket.env().items():
        monkeypatch.setenv(k, v)
    uri = f"s3://{s3_bucket.bucket}/jobs/example-a"
    check_example_a(open_storage(uri), uri, s3_bucket.env())


@pytest.mark.s3
def test_example_b_on_s3(s3_bucket: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in s3_bucket.env().items():
        monkeypatch.setenv(k, v)
    uri = f"s3://{s3_bucket.bucket}/jobs/example-b"
    check_example_b(open_storage(uri), uri, s3_bucket.env())
