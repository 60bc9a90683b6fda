"""Dynamic sampling in the owners: a step's groups without signal leave filtered, with their
reason, and a refill round of spares takes their places; which groups a step trains does not
depend on the order its groups finish in, and a restore from a cut taken after any ownership
move, through the cut's bytes, trains the same stream as the run that never stopped."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from scripted_generation import new_owners, rollout

from spotrl_runtime.core.accounting import summarize
from spotrl_runtime.core.audit import FILTERED, AuditRecord
from spotrl_runtime.core.cut_format import decode_owner_files, encode_owner_files, to_snapshot
from spotrl_runtime.core.dynamic_sampling import ZERO_STD, without_signal
from spotrl_runtime.core.ledger import LedgerRecord
from spotrl_runtime.core.owners import Dispatch, Owners, OwnersSnapshot, RecoveryConfig
from spotrl_runtime.core.types import FinishedGroup, Rollout
from spotrl_runtime.data import ArithmeticDataset, PromptCollate
from spotrl_runtime.data.loader import PromptLoader

SIZE = 60
Flat = Callable[[int], bool]
Order = Callable[[list[Dispatch]], Dispatch]


def every_third(idx: int) -> bool:
    """Rows 0, 3, 6, ... score the same reward on every rollout: no signal."""
    return idx % 3 == 0


def scored(d: Dispatch, flat: Flat) -> list[Rollout]:
    return [replace(rollout(d, i), reward=1.0 if flat(d.prompt.idx) else float(i % 2)) for i in d.rollout_indexes]


def config(**kw: Any) -> RecoveryConfig:
    base: dict[str, Any] = dict(group_size=2, prompts_per_step=4, lookahead=0, dynamic_max_rounds=3)
    return RecoveryConfig(**(base | kw))


def first(flight: list[Dispatch]) -> Dispatch:
    return min(flight, key=lambda d: d.group_id[1:].zfill(6))


def last(flight: list[Dispatch]) -> Dispatch:
    return max(flight, key=lambda d: d.group_id[1:].zfill(6))


def shuffled(seed: int) -> Order:
    rng = random.Random(seed)
    return lambda flight: rng.choice(flight)


def move(owners: Owners, order: Order, flat: Flat) -> AuditRecord | None:
    """One ownership move: the gate and refills pump, then a step trains if it can, else one
    in-flight group (picked by ``order``) finishes."""
    owners.pump()
    if owners.step_ready():
        owners.begin_step()
        return owners.commit_step()
    flight = owners.in_flight()
    assert flight, f"step {owners.trainer_step} is neither ready nor generating"
    d = order(flight)
    owners.finish_group(d.group_id, scored(d, flat))
    return None


def run(owners: Owners, steps: int, order: Order = first, flat: Flat = every_third) -> list[AuditRecord]:
    records = []
    while owners.trainer_step < steps:
        record = move(owners, order, flat)
        if record is not None:
            records.append(record)
    return records


def through_bytes(snap: OwnersSnapshot) -> OwnersSnapshot:
    """The snapshot as a restore reads it back from the cut's owner files."""
    docs = decode_owner_files(encode_owner_files(snap))
    docs = type(docs)(**{**docs.__dict__, "ledger": tuple(LedgerRecord.from_json(r) for r in docs.ledger_raw)})
    return to_snapshot(docs, snap.prompts | {e.group_id: e.group.prompt for e in snap.replay})


def restored(snap: OwnersSnapshot, batch: int) -> Owners:
    loader = PromptLoader(ArithmeticDataset(size=SIZE), PromptCollate(), batch_size=batch, shuffle=False)
    return Owners.restore(through_bytes(snap), loader, attempt=1)


def key(records: list[AuditRecord]) -> list[Any]:
    return [(r.step, r.group_ids, r.idxs, r.rounds, [(d.idx, d.state, d.reason) for d in r.dropped]) for r in records]


# ------------------------------------------------------------------------ the filter


def test_a_group_has_no_signal_exactly_when_its_rewards_are_all_equal() -> None:
    def group(*rewards: float) -> FinishedGroup:
        d = Dispatch("g0", new_owners(config()).pump()[0].prompt, 0, (0,), 0)
        return FinishedGroup(
            "g0", d.prompt, 0, tuple(replace(rollout(d, 0), index=i, reward=r) for i, r in enumerate(rewards))
        )

    assert without_signal(group(0.5, 0.5, 0.5)) == f"{ZERO_STD}: its 3 rewards were all 0.5 (dynamic sampling)"
    assert without_signal(group(0.0, 0.0, 1e-9)) is None
    assert without_signal(group(1.0, 0.0)) is None


# ------------------------------------------------------------------ refill rounds


def test_groups_without_signal_are_filtered_and_a_refill_round_takes_their_places() -> None:
    owners = new_owners(config(), size=SIZE)
    (record,) = run(owners, 1)
    # Step 0 is rows 0-3 (rows 4-7 wait at the gate): rows 0 and 3 have no signal. Round 1 reads
    # rows 8-11 into the pool and takes 8 and 9; 9 has none either, so round 2 takes 10, and 11
    # stays in the pool for the next refill.
    assert record.idxs == (1, 2, 8, 10)
    assert record.rounds == 2
    reasons = [(d.idx, d.state, d.reason) for d in record.dropped]
    assert reasons == [(i, FILTERED, f"{ZERO_STD}: its 2 rewards were all 1 (dynamic sampling)") for i in (0, 3, 9)]
    assert owners.census()["spare_pool"] == 1
    assert owners.counters.prompts_filtered == 3


def test_a_refill_round_without_signal_is_refilled_in_turn_and_the_last_round_trains() -> None:
    owners = new_owners(config(dynamic_max_rounds=2), size=SIZE)
    (record,) = run(owners, 1, flat=lambda idx: True)
    # Round 0: rows 0-3 (4-7 wait at the gate), round 1: rows 8-11, round 2 (the last): rows
    # 12-15 train as they are.
    assert record.idxs == (12, 13, 14, 15)
    assert record.rounds == 2
    assert [d.idx for d in record.dropped] == [0, 1, 2, 3, 8, 9, 10, 11]
    acc = summarize([record.to_json()])
    assert (acc.prompts_trained, acc.prompts_filtered, acc.prompts_dropped, acc.prompts_lost) == (4, 8, 0, 0)


def test_without_dynamic_sampling_groups_without_signal_train() -> None:
    owners = new_owners(config(dynamic_max_rounds=None), size=SIZE)
    (record,) = run(owners, 1)
    assert (record.idxs, record.rounds, record.dropped) == ((0, 1, 2, 3), 0, ())


def test_filtered_groups_are_never_trained_and_each_prompt_is_counted_once() -> None:
    records = run(new_owners(config(lookahead=1), size=SIZE), 6, order=shuffled(3))
    trained = [i for r in records for i in r.idxs]
    filtered = [d.idx for r in records for d in r.dropped]
    assert not set(trained) & set(filtered)
    assert len(trained) == len(set(trained)) == 6 * 4
    assert all(every_third(i) for i in filtered)
    assert filtered
    # Only the last round may train a group without signal.
    assert all(not every_third(i) for r in records for i in r.idxs if r.rounds < 3)


@pytest.mark.parametrize("lookahead", [0, 1, 2])
def test_the_stream_does_not_depend_on_the_order_groups_finish_in(lookahead: int) -> None:
    def stream(order: Order) -> list[Any]:
        owners = new_owners(config(lookahead=lookahead), size=SIZE)
        return [*key(run(owners, 5, order=order)), owners.capture().loader_state]

    reference = stream(first)
    assert stream(last) == reference
    for seed in range(3):
        assert stream(shuffled(seed)) == reference


@pytest.mark.parametrize("policy", ["shrink", "replace"])
def test_a_restore_from_a_cut_after_any_move_trains_the_stream_of_the_run_that_never_stopped(policy: str) -> None:
    cfg = config(lookahead=1, on_dropped_prompt=policy, spare_pool_batches=1)
    whole = run(new_owners(cfg, size=SIZE), 4)
    moves = 0
    while True:
        owners, done = new_owners(cfg, size=SIZE), []
        for _ in range(moves):
            record = move(owners, first, every_third)
            if record is not None:
                done.append(record)
        if owners.trainer_step >= 4:
            break
        snap = owners.capture()
        back = restored(snap, cfg.prompts_per_step)
        back.pump()  # the groups the cut held in flight go first, then the gate
        assert key(done + run(back, 4)) == key(whole), f"restored after move {moves}"
        moves += 1
    assert moves > 20


def test_the_round_and_the_config_survive_the_cut_and_old_cuts_read_as_round_0() -> None:
    owners = new_owners(config(), size=SIZE)
    while not any(r.round for r in owners.capture().ledger):
        move(owners, first, every_third)
    snap = owners.capture()
    back = through_bytes(snap)
    assert back.config.dynamic_max_rounds == 3
    assert [r.round for r in back.ledger] == [r.round for r in snap.ledger]
    assert max(r.round for r in back.ledger) == 1
    raw = json.loads(encode_owner_files(snap)["ledger"])["records"]
    assert [r.get("round", 0) for r in raw] == [r.round for r in snap.ledger]
    assert all(r["round"] > 0 for r in raw if "round" in r), "round 0 is not written: old cuts stay as they were"
    assert "dynamic_max_rounds" not in config(dynamic_max_rounds=None).to_json()
    old = {k: v for k, v in snap.ledger[0].to_json().items() if k != "round"}
    assert LedgerRecord.from_json(old).round == 0
