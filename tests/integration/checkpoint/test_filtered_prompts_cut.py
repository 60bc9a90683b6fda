"""Prompts filtered at admission across a real cut: the cut (written, validated by the whole
chain, restored) holds the filter's limit and the filtered prompts of the steps not yet
trained, and the resumed run filters and trains exactly what the run never stopped did."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cut_scenarios import DATASET, Run

from spotrl_runtime.core.audit import FILTERED, AuditRecord
from spotrl_runtime.core.owners import RecoveryConfig
from spotrl_runtime.core.types import Prompt
from spotrl_runtime.storage import open_storage


def tokens(prompt: Prompt) -> int:
    """Every fourth row, from row 1, is too long for the limit below."""
    return 100 if prompt.idx % 4 == 1 else 8


def config(policy: str) -> RecoveryConfig:
    return RecoveryConfig(
        group_size=2,
        prompts_per_step=3,
        lookahead=1,
        on_dropped_prompt=policy,  # type: ignore[arg-type]
        spare_pool_batches=1,
        min_step_fraction=0.3,
        max_model_len=64,
        max_new_tokens=16,
    )


def filtering(run: Run) -> Run:
    limit = run.owners.config.prompt_limit  # after a restore: the cut's
    assert limit is not None
    run.owners.set_admission_filter(limit.filter(tokens))
    return run


def key(records: list[AuditRecord]) -> list[Any]:
    return [(r.step, r.group_ids, r.idxs, [(d.group_id, d.state, d.reason) for d in r.dropped]) for r in records]


@pytest.mark.parametrize("policy", ["shrink", "replace"])
def test_a_cut_holding_filtered_prompts_resumes_to_the_same_stream(tmp_path: Path, policy: str) -> None:
    reference = filtering(Run.new(config(policy), DATASET))
    reference.drain(6)

    storage = open_storage(str(tmp_path / "cuts"))
    run = filtering(Run.new(config(policy), DATASET, storage))
    run.drain(2)
    run.pump()
    snap = run.owners.capture()
    pending = [d for step, left in snap.dropped.items() if step >= snap.trainer_step for d in left]
    assert any(d.state == FILTERED for d in pending), "the cut holds a filtered prompt of a step not trained yet"
    run.cut("barrier")

    resumed = filtering(Run.restore(config(policy), DATASET, storage))
    assert resumed.owners.config == config(policy)
    resumed.drain(6)

    assert key(run.audit + resumed.audit) == key(reference.audit)
    trained = [i for r in reference.audit for i in r.idxs]
    filtered = [d.idx for r in reference.audit for d in r.dropped if d.state == FILTERED]
    assert filtered
    assert all(i % 4 == 1 for i in filtered)
    assert not any(i % 4 == 1 for i in trained), "no long prompt was trained"
    if policy == "replace":
        assert any(len(r.idxs) == 3 and r.dropped for r in reference.audit), "a spare filled a filtered place"
    else:
        assert all(len(r.idxs) == 3 - len(r.dropped) for r in reference.audit), "each filtered place shrank its step"
