"""Property: random sequences of loader, admit, finish, drop, train and cut events, an abrupt
loss at a random point, a restore from a random committed cut (in a new controller) and
the same events again: the effective stream of prompts trained per step, the final weights,
and the fate of every prompt equal those of the run that never stopped."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Any

import pytest
from cut_scenarios import Run
from hypothesis import HealthCheck, given, settings, target
from hypothesis import event as note
from hypothesis import strategies as st

from spotrl_runtime.checkpoint import list_cut_folders
from spotrl_runtime.core.audit import AuditRecord, effective_stream
from spotrl_runtime.core.owners import RecoveryConfig, StepTooSmallError
from spotrl_runtime.data import ArithmeticDataset
from spotrl_runtime.storage import LocalStorage

DATASET = ArithmeticDataset(size=11)  # small, so runs cross epochs

configs = st.builds(
    lambda g, b, lookahead, policy: RecoveryConfig(
        group_size=g,
        prompts_per_step=b,
        lookahead=lookahead,
        on_dropped_prompt=policy,
        min_step_fraction=0.34,
        spare_pool_batches=1 if policy == "replace" else 0,
    ),
    st.integers(2, 3),
    st.integers(1, 3),
    st.integers(0, 2),
    st.sampled_from(["shrink", "replace", "replace"]),
)
# Weighted so that steps complete, train, and get cut often enough for restores to matter.
KINDS = ["pump", "finish", "finish_latest", "partial", "drop", "drop_earliest", "cut", "train"] * 2 + ["partial", "cut"]
events = st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 8)), min_size=12, max_size=40)


def apply(run: Run, event: tuple[str, int]) -> str | None:
    """Runs one event; returns the id of the cut it committed, if any."""
    kind, k = event
    targets = run.targets()
    if kind == "pump":
        run.pump()
    elif kind == "train":
        # The trainer waits for its step: generation finishes that step's groups first.
        for gid in targets:
            if run.inflight[gid].target_step == run.owners.trainer_step:
                run.finish(gid)
        if run.owners.step_ready():
            run.train()
    elif kind == "cut":
        cut_id = run.cut().cut_id
        run.pump()
        return cut_id
    elif kind == "finish_all":
        for gid in targets:
            run.finish(gid)
    elif kind == "drop_earliest" and targets:
        # The group due first fails: under 'replace' a later, finished step lends it a group.
        with contextlib.suppress(StepTooSmallError):
            run.drop(min(targets, key=lambda g: (run.inflight[g].target_step, g)))
    elif kind == "finish_latest" and targets:
        # Out of order: the group stamped furthest ahead finishes first (it can then be lent).
        run.finish(max(targets, key=lambda g: (run.inflight[g].target_step, g)))
    elif targets:
        gid = targets[k % len(targets)]
        if kind == "finish":
            run.finish(gid)
        elif kind == "partial":
            run.finish(gid, run.inflight[gid].rollout_indexes[:1])
        else:
            # A refused drop means the run would stop here; it changed nothing, so both arms go on alike.
            with contextlib.suppress(StepTooSmallError):
                run.drop(gid)
    return None


def fates(run: Run, records: list[AuditRecord]) -> dict[str, str]:
    """group_id -> its one owner at the end; asserts nobody has two."""
    snap = run.owners.capture()
    out: dict[str, str] = {}
    stream = effective_stream(records)
    groups: list[tuple[str, str]] = [(r.group_id, "ledger") for r in snap.ledger]
    groups += [(e.group_id, "replay") for e in snap.replay]
    groups += [(s.group_id, "spare") for s in snap.spares]
    groups += [(d.group_id, f"dropped@{step}") for step, ds in snap.dropped.items() for d in ds]  # step not trained yet
    groups += [(g, f"trained@{rec.step}") for rec in stream.values() for g in rec.group_ids]
    groups += [(d.group_id, f"dropped@{rec.step}") for rec in stream.values() for d in rec.dropped]
    for gid, fate in groups:
        assert gid not in out, f"{gid} is both {out[gid]} and {fate}"
        out[gid] = fate
    assert set(out) == {f"g{n}" for n in range(snap.next_order)}, "every prompt taken from the loader has a fate"
    return out


def stream_of(records: list[AuditRecord]) -> dict[int, Any]:
    return {s: (r.group_ids, r.idxs, [d.group_id for d in r.dropped]) for s, r in effective_stream(records).items()}


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=configs,
    script=events,
    seed=st.integers(0, 3),
    crash_percent=st.integers(0, 100),
    pick=st.integers(0, 9),
)
def test_restored_runs_train_the_same_prompts_as_the_run_that_never_stopped(
    config: RecoveryConfig, script: list[tuple[str, int]], seed: int, crash_percent: int, pick: int
) -> None:
    loader = {"shuffle": True, "seed": seed}
    with tempfile.TemporaryDirectory() as tmp:
        # The run that never stopped.
        reference = Run.new(config, DATASET, LocalStorage(Path(tmp) / "reference"), **loader)
        for event in script:
            apply(reference, event)
        final_step = reference.owners.trainer_step + 2
        reference.drain(final_step)

        # The same run, lost abruptly after `crash_at` events (everything after its last
        # commit is gone), restored from one of its committed cuts by a new controller.
        storage = LocalStorage(Path(tmp) / "faulty")
        crash_at = len(script) * crash_percent // 100
        lost = Run.new(config, DATASET, storage, **loader)
        cut_at: dict[str, int] = {}
        for n, event in enumerate(script[:crash_at]):
            cut_id = apply(lost, event)
            if cut_id is not None:
                cut_at[cut_id] = n
        kept = [f.cut_id for f in list_cut_folders(storage) if f.committed]
        if kept:
            chosen = kept[pick % len(kept)]
            run = Run.restore(config, DATASET, storage, chosen, **loader)
            assert run.owners.attempt == 1
            run.pump()  # the pump that followed the cut event
            resume_from = cut_at[chosen] + 1
        else:
            run = Run.new(config, DATASET, storage, attempt=1, **loader)  # no cut yet: start over
            resume_from = 0
        for event in script[resume_from:]:
            apply(run, event)
        run.drain(final_step)

        retrained = len(lost.audit) - (run.audit[0].step if run.audit else len(lost.audit))
        note("restored from a cut" if kept else "no cut before the loss: started over")
        note(f"steps trained again after the loss: {'some' if retrained else 'none'}")
        note(f"borrows (replace): {'some' if reference.owners.counters.borrows else 'none'}")
        note(f"finished siblings reused: {'some' if run.owners.counters.rollouts_reused else 'none'}")
        note(f"in-flight groups relaunched: {'some' if run.owners.counters.groups_relaunched else 'none'}")
        target(float(retrained + run.owners.counters.groups_relaunched), label="recovery work")
        records = lost.audit + run.audit
        assert stream_of(records) == stream_of(reference.audit)
        assert run.weights() == reference.weights()
        assert fates(run, records) == fates(reference, reference.audit)
        assert run.owners.counters.groups_discarded == 0
        trained = [g for rec in effective_stream(records).values() for g in rec.group_ids]
        assert len(trained) == len(set(trained)), "no prompt is trained twice in the effective stream"
