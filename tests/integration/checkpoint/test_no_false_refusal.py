"""Property: no check of the validation chain refuses a cut that the real writer made.

Random runs (drops under 'shrink' and 'replace', borrows, partial groups, a dataset of 11
rows so runs cross epochs) take periodic and barrier cuts and resume from the newest one
several times, each time in a new run. Every committed cut passes the whole chain, with the
job's expectations and the prompt encoder, i.e. every check runs.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from cut_scenarios import JOB, Run, dataset_description
from hypothesis import HealthCheck, given, settings
from hypothesis import event as note
from hypothesis import strategies as st
from test_recovery_property import apply, configs

from spotrl_runtime.checkpoint.restore import DatasetLookup, validate_stored_cut
from spotrl_runtime.core.owners import RecoveryConfig
from spotrl_runtime.core.types import Prompt
from spotrl_runtime.core.validation import CHECKS, DELTA_CHECKS, Expectations, PolicyExpectation
from spotrl_runtime.data import ArithmeticDataset, PromptCollate
from spotrl_runtime.storage import LocalStorage

DATASET = ArithmeticDataset(size=11)
# The events of test_recovery_property (its `apply`), and cuts of both kinds and resumes here.
KINDS = ["pump", "finish", "finish_latest", "partial", "drop", "drop_earliest", "train", "train"]
KINDS += ["cut", "barrier", "delta", "resume"]
events = st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 8)), min_size=15, max_size=45)


def encode(prompt: Prompt) -> tuple[int, ...]:
    return tuple(ord(c) for c in prompt.text)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, script=events, seed=st.integers(0, 3))
def test_every_cut_the_writer_commits_passes_every_check(
    config: RecoveryConfig, script: list[tuple[str, int]], seed: int
) -> None:
    loader = {"shuffle": True, "seed": seed}
    policy = PolicyExpectation(None)  # the scenario trains every weight of its model
    expect = Expectations(job=JOB, config=config, dataset=dataset_description(DATASET, **loader), policy=policy)
    lookup = DatasetLookup(DATASET, PromptCollate())
    with tempfile.TemporaryDirectory() as tmp:
        storage = LocalStorage(Path(tmp) / "job")
        run = Run.new(config, DATASET, storage, **loader)
        resumes = cuts = 0
        for kind, k in script:
            if kind in ("cut", "barrier", "delta"):
                committed = run.cut("periodic" if kind == "cut" else kind)
                cuts += 1
                validated = validate_stored_cut(storage, committed.cut_id, lookup, expect, encode=encode)
                # Every check ran, but the redo's own (a full cut: the delta's too; a delta, which
                # holds no trainer state, leaves the policy's identity to its base's chain).
                delta = committed.manifest.is_delta
                skipped = {"redo_fingerprint"} | ({"policy_identity"} if delta else DELTA_CHECKS)
                assert validated.checks == tuple(c for c in CHECKS if c not in skipped), "every check ran"
                if committed.manifest.is_delta:
                    base = committed.manifest.base
                    assert base is not None
                    note(f"a delta cut redoing {min(committed.manifest.trainer_step - base.trainer_step, 3)}+ steps")
                docs = validated.documents
                if docs.shortfall:
                    note("a cut with a shortfall")
                if run.owners.counters.borrows:
                    note("a cut after a borrow")
                if docs.next_order > len(DATASET):
                    note("a cut past an epoch boundary")
                if any(r.group_id in docs.rollouts for r in docs.ledger):
                    note("a cut with finished siblings of an in-flight group")
            elif kind == "resume" and cuts:
                run = Run.restore(config, DATASET, storage, **loader)
                run.pump()
                resumes += 1
            else:
                apply(run, (kind, k))
        note(f"resumes: {min(resumes, 3)}{'+' if resumes > 3 else ''}")
