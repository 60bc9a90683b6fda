"""The owners and the moves between them: gate, stamps, finish, drop (shrink and replace), train, capture."""

from __future__ import annotations

import threading
import time

import pytest
from scripted_generation import new_owners, rollout, rollouts

from spotrl_runtime.core.ledger import Phase
from spotrl_runtime.core.owners import (
    AdmissionIntoFinishedStepError,
    CutTimeoutError,
    Dispatch,
    Owners,
    OwnersSnapshot,
    RecoveryConfig,
    RolloutMismatchError,
    StepNotReadyError,
    StepTooSmallError,
    UnknownGroupError,
)
from spotrl_runtime.data import ArithmeticDataset, PromptCollate
from spotrl_runtime.data.loader import PromptLoader


def by_id(dispatches: list[Dispatch]) -> dict[str, Dispatch]:
    return {d.group_id: d for d in dispatches}


def stamps(snapshot: OwnersSnapshot) -> dict[int, list[int]]:
    """Step -> prompt idxs (finished and in flight), as the notes print them."""
    out: dict[int, list[tuple[int, int]]] = {}
    for e in snapshot.replay:
        out.setdefault(e.target_step, []).append((e.order, e.group.prompt.idx))
    for r in snapshot.ledger:
        if r.target_step is not None:
            out.setdefault(r.target_step, []).append((r.order, r.idx))
    return {s: [idx for _, idx in sorted(v)] for s, v in sorted(out.items())}


def owner_map(snapshot: OwnersSnapshot) -> dict[str, str]:
    """group_id -> owner; raises if any group has two."""
    owners: dict[str, str] = {}
    for name, ids in (
        ("ledger", [r.group_id for r in snapshot.ledger]),
        ("replay", [e.group_id for e in snapshot.replay]),
        ("spare", [s.group_id for s in snapshot.spares]),
    ):
        for gid in ids:
            assert gid not in owners, f"{gid} owned by {owners[gid]} and {name}"
            owners[gid] = name
    return owners


def test_gate_stamps_batches_and_keeps_one_reserved() -> None:
    owners = new_owners(RecoveryConfig(group_size=2, prompts_per_step=2, lookahead=1))
    sent = owners.pump()
    # Trainer at 0, lookahead 1: steps 0 and 1 admitted, the third batch waits at the gate.
    assert [(d.group_id, d.target_step) for d in sent] == [("g0", 0), ("g1", 0), ("g2", 1), ("g3", 1)]
    assert all(d.rollout_indexes == (0, 1) for d in sent)
    assert owners.dispatch_index == 1
    snap = owners.capture()
    assert [(r.group_id, r.phase) for r in snap.ledger if r.phase is Phase.RESERVED] == [
        ("g4", Phase.RESERVED),
        ("g5", Phase.RESERVED),
    ]
    assert owners.pump() == [], "the gate stays shut until the trainer moves"
    for d in sent[:2]:
        owners.finish_group(d.group_id, rollouts(d))
    groups = owners.begin_step()
    assert [g.group_id for g in groups] == ["g0", "g1"]
    assert owners.commit_step().step == 0
    assert [(d.group_id, d.target_step) for d in owners.pump()] == [("g4", 2), ("g5", 2)]


def test_lookahead_zero_is_synchronous() -> None:
    owners = new_owners(RecoveryConfig(group_size=2, prompts_per_step=1, lookahead=0))
    assert [d.target_step for d in owners.pump()] == [0]
    assert owners.pump() == []


def test_the_gate_waits_for_the_weights_of_the_step_not_only_its_commit() -> None:
    """Committed step 0, weights 1 not yet sent: with lookahead 0 nothing may be generated with
    weights 0 for step 1; once weights 1 are out, step 1's batch goes, stamped with them."""
    owners = new_owners(RecoveryConfig(group_size=2, prompts_per_step=1, lookahead=0))
    (d,) = owners.pump(weight_version=0)
    owners.finish_group(d.group_id, rollouts(d))
    owners.begin_step()
    owners.commit_step(weight_version=1)
    assert owners.pump(weight_version=0) == []
    (d,) = owners.pump(weight_version=1)
    assert (d.target_step, d.weight_version) == (1, 1)


def test_group_finished_is_one_mutation_and_rollouts_are_checked() -> None:
    owners = new_owners(RecoveryConfig(group_size=3, prompts_per_step=1, lookahead=0))
    (d,) = owners.pump()
    assert owners.add_rollout("g0", rollout(d, 2)) is None
    with pytest.raises(RolloutMismatchError, match="twice"):
        owners.add_rollout("g0", rollout(d, 2))
    with pytest.raises(RolloutMismatchError, match="outside"):
        owners.add_rollout("g0", rollout(d, 3))
    with pytest.raises(RolloutMismatchError, match="handed in for group g0"):
        owners.add_rollout("g0", rollout(Dispatch("g9", d.prompt, 0, (0,), 0), 0))
    with pytest.raises(RolloutMismatchError, match="would have 2 of 3 rollouts"):
        owners.finish_group("g0", [rollout(d, 0)])
    snap = owners.capture()
    assert [len(v) for v in snap.partial.values()] == [1], "a rejected call changes nothing"
    with pytest.raises(UnknownGroupError, match="RESERVED"):
        owners.add_rollout("g1", rollout(d, 0))
    group = owners.finish_group("g0", [rollout(d, 0), rollout(d, 1)])
    assert group is not None
    assert [r.index for r in group.rollouts] == [0, 1, 2]
    snap = owners.capture()
    assert owner_map(snap)["g0"] == "replay"
    assert "g0" not in snap.partial
    with pytest.raises(UnknownGroupError, match="not in the ledger"):
        owners.add_rollout("g0", rollout(d, 0))


def test_drop_with_shrink_persists_the_shortfall_and_refuses_below_min_fraction() -> None:
    owners = new_owners(RecoveryConfig(group_size=2, prompts_per_step=4, lookahead=0, min_step_fraction=0.5))
    sent = by_id(owners.pump())
    assert owners.drop_group("g1", "generation failed") == []
    assert owners.drop_group("g2", "filtered") == []
    before = owners.capture()
    assert before.shortfall == {0: 2}
    with pytest.raises(StepTooSmallError, match="1 of 4 groups"):
        owners.drop_group("g3", "failed")
    after = owners.capture()
    assert after.ledger == before.ledger, "a refused drop changes nothing"
    assert after.shortfall == {0: 2}
    for gid in ("g0", "g3"):
        owners.finish_group(gid, rollouts(sent[gid]))
    assert [g.group_id for g in owners.begin_step()] == ["g0", "g3"]
    record = owners.commit_step()
    assert record.group_ids == ("g0", "g3")
    assert [(d.group_id, d.reason) for d in record.dropped] == [("g1", "generation failed"), ("g2", "filtered")]
    assert owners.capture().shortfall == {}
    assert owners.counters.prompts_dropped == 2


def test_replace_borrows_from_the_furthest_step_and_repays_with_the_lenders_stamp() -> None:
    """The live half of worked example B."""
    config = RecoveryConfig(
        group_size=2, prompts_per_step=3, lookahead=2, on_dropped_prompt="replace", spare_pool_batches=1
    )
    owners = new_owners(config)
    sent = by_id(owners.pump())
    snap = owners.capture()
    assert stamps(snap) == {0: [0, 1, 2], 1: [6, 7, 8], 2: [9, 10, 11]}
    assert [s.idx for s in snap.spares] == [3, 4, 5]
    assert [r.idx for r in snap.ledger if r.phase is Phase.RESERVED] == [12, 13, 14]
    for gid in ("g0", "g2", "g6", "g7", "g8", "g9", "g10", "g11"):
        owners.finish_group(gid, rollouts(sent[gid]))
    (spare,) = owners.drop_group("g1", "generation failed after retries")
    assert (spare.group_id, spare.prompt.idx, spare.target_step) == ("g3", 3, 2)
    snap = owners.capture()
    assert stamps(snap) == {0: [0, 2, 9], 1: [6, 7, 8], 2: [3, 10, 11]}
    assert sum(1 for _ in snap.replay) == 8
    assert [(r.idx, r.phase, r.target_step) for r in snap.ledger] == [
        (3, Phase.ADMITTED, 2),
        (12, Phase.RESERVED, None),
        (13, Phase.RESERVED, None),
        (14, Phase.RESERVED, None),
    ]
    assert snap.dispatch_index == 2
    assert [s.idx for s in snap.spares] == [4, 5]
    assert owners.counters.borrows == 1


def test_replace_without_a_lender_gives_the_spare_the_dropped_stamp() -> None:
    config = RecoveryConfig(
        group_size=2, prompts_per_step=2, lookahead=0, on_dropped_prompt="replace", spare_pool_batches=1
    )
    owners = new_owners(config)
    owners.pump()
    (spare,) = owners.drop_group("g0", "failed")
    assert spare.target_step == 0
    assert owners.counters.borrows == 0


def test_replace_with_an_empty_pool_shrinks_and_counts_it() -> None:
    config = RecoveryConfig(
        group_size=2, prompts_per_step=2, lookahead=0, on_dropped_prompt="replace", spare_pool_batches=1
    )
    owners = new_owners(config)
    owners.pump()
    owners.drop_group("g0", "failed")  # uses both...
    owners.drop_group("g1", "failed")  # ...spares
    owners.drop_group("g2", "failed")
    assert owners.capture().shortfall == {0: 1}
    assert owners.counters.replace_fallbacks == 1


def test_admitting_into_a_step_with_finished_groups_raises_and_changes_nothing() -> None:
    owners = new_owners(RecoveryConfig(group_size=2, prompts_per_step=2, lookahead=1))
    sent = by_id(owners.pump())
    for gid in ("g0", "g1", "g2"):
        owners.finish_group(gid, rollouts(sent[gid]))
    good = owners.capture()
    # A snapshot whose cursor was rebuilt from the trainer step (-1) instead of the saved 1.
    bad = OwnersSnapshot(**{**good.__dict__, "dispatch_index": -1})
    loader = PromptLoader(ArithmeticDataset(size=1000), PromptCollate(), batch_size=2, shuffle=False)
    restored = Owners.restore(bad, loader, attempt=1)
    with pytest.raises(AdmissionIntoFinishedStepError, match="step 0 already holds 2 finished"):
        restored.pump()
    assert restored.counters.groups_discarded == 0
    after = restored.capture()
    assert [r.phase for r in after.ledger if r.group_id in ("g4", "g5")] == [Phase.RESERVED, Phase.RESERVED]


def test_training_needs_a_complete_step_and_abort_keeps_the_groups() -> None:
    owners = new_owners(RecoveryConfig(group_size=2, prompts_per_step=2, lookahead=0))
    sent = by_id(owners.pump())
    owners.finish_group("g0", rollouts(sent["g0"]))
    assert not owners.step_ready()
    with pytest.raises(StepNotReadyError, match="1 groups generating"):
        owners.begin_step()
    owners.finish_group("g1", rollouts(sent["g1"]))
    assert owners.wait_step_ready(timeout=1)
    owners.begin_step()
    with pytest.raises(StepNotReadyError, match="already being trained"):
        owners.begin_step()
    owners.abort_step()
    assert [g.group_id for g in owners.begin_step()] == ["g0", "g1"]
    record = owners.commit_step(weight_version=7)
    assert (record.step, record.weight_version, record.idxs) == (0, 7, (0, 1))
    assert owners.trainer_step == 1
    with pytest.raises(StepNotReadyError, match="commit_step without begin_step"):
        owners.commit_step()


def test_capture_waits_for_a_running_step_and_times_out_if_it_never_ends() -> None:
    owners = new_owners(RecoveryConfig(group_size=2, prompts_per_step=1, lookahead=0))
    (d,) = owners.pump()
    owners.finish_group(d.group_id, rollouts(d))
    owners.begin_step()
    with pytest.raises(CutTimeoutError, match="step 0 was still training"):
        owners.capture(timeout=0.05)
    result: list[OwnersSnapshot] = []
    t = threading.Thread(target=lambda: result.append(owners.capture(timeout=5)))
    t.start()
    time.sleep(0.05)
    assert not result, "the cut waits for the optimizer step to commit"
    owners.commit_step()
    t.join()
    assert result[0].trainer_step == 1
    assert result[0].replay == ()


def test_concurrent_completions_and_cuts_always_see_one_owner_per_prompt() -> None:
    config = RecoveryConfig(group_size=4, prompts_per_step=8, lookahead=3)
    owners = new_owners(config)
    issued: list[Dispatch] = owners.pump()
    lock = threading.Lock()
    stop = threading.Event()
    snapshots: list[OwnersSnapshot] = []

    def generate(worker: int) -> None:
        while not stop.is_set():
            with lock:
                d = issued.pop(0) if issued else None
            if d is None:
                time.sleep(0.001)
                continue
            for i in d.rollout_indexes:
                owners.add_rollout(d.group_id, rollout(d, i))

    def train() -> None:
        while not stop.is_set():
            if owners.wait_step_ready(timeout=0.01):
                owners.begin_step()
                owners.commit_step()
                new = owners.pump()
                with lock:
                    issued.extend(new)

    def cut() -> None:
        while not stop.is_set():
            snapshots.append(owners.capture(lambda: owners.trainer_step, timeout=5))

    threads = [threading.Thread(target=generate, args=(n,)) for n in range(3)]
    threads += [threading.Thread(target=train), threading.Thread(target=cut)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while owners.trainer_step < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    for t in threads:
        t.join()
    assert owners.trainer_step >= 20
    assert len(snapshots) > 5
    for snap in snapshots:
        owners_of = owner_map(snap)
        trained = {g for rec in snap.audit_tail for g in rec.group_ids}
        assert not trained & set(owners_of), "a trained group has no other owner"
        # Every group id issued so far is owned exactly once: ledger, replay or trained.
        assert set(owners_of) | trained == {f"g{n}" for n in range(snap.next_order)}
        assert snap.extra == snap.trainer_step, "state_fn runs under the lock, consistent with the step"
        for e in snap.replay:
            assert e.target_step >= snap.trainer_step
            assert len(e.group.rollouts) == 4


def test_recovery_config_from_an_rljob_spec() -> None:
    from spotrl_runtime.api.rljob import parse_spec

    spec = parse_spec(
        {
            "policy": {"model": "builtin:tiny-arith"},
            "dataset": {"uri": "builtin:arithmetic"},
            "reward": {"name": "arithmetic_exact"},
            "training": {"totalSteps": 10},
            "generation": {"groupSize": 3, "promptsPerStep": 5, "lookahead": 2},
            "preemption": {"onDroppedPrompt": "replace", "sparePoolBatches": 2, "minStepFraction": 0.6},
        }
    )
    config = RecoveryConfig.from_spec(spec)
    assert (config.group_size, config.prompts_per_step, config.lookahead) == (3, 5, 2)
    assert (config.on_dropped_prompt, config.spare_pool_batches, config.min_step_fraction) == ("replace", 2, 0.6)
    assert config.min_groups_per_step == 3
    assert RecoveryConfig.from_json(config.to_json()) == config
