"""The admission filter: a prompt too long for maxModelLen is filtered when the gate stamps it,
with its reason, and its place is filled as onDroppedPrompt says (shrink, replace); a resume
from the owners' snapshot filters exactly the same prompts."""

from __future__ import annotations

from typing import Any

import pytest
from scripted_generation import new_owners, rollouts

from spotrl_runtime.core.accounting import format_summary, summarize
from spotrl_runtime.core.admission import MODEL_POSITIONS, PromptLimit, prompt_limit
from spotrl_runtime.core.audit import FILTERED, AuditRecord, DroppedPrompt
from spotrl_runtime.core.fields import RecordFormatError
from spotrl_runtime.core.owners import (
    Dispatch,
    Owners,
    OwnershipError,
    RecoveryConfig,
    StepTooSmallError,
    UnknownGroupError,
)
from spotrl_runtime.core.types import Prompt
from spotrl_runtime.data import ArithmeticDataset, PromptCollate
from spotrl_runtime.data.loader import PromptLoader

LIMIT = PromptLimit(max_model_len=256, max_new_tokens=64)


def tokens(prompt: Prompt) -> int:
    """A prompt's length: rows 1, 5, 6 and 9 of the dataset are long (300 tokens), the rest short."""
    return 300 if prompt.idx in (1, 5, 6, 9) else 10


def config(**kw: Any) -> RecoveryConfig:
    base: dict[str, Any] = dict(group_size=2, prompts_per_step=4, lookahead=0, max_model_len=256, max_new_tokens=64)
    return RecoveryConfig(**(base | kw))


def filtering(cfg: RecoveryConfig) -> Owners:
    owners = new_owners(cfg, size=40)
    limit = cfg.prompt_limit
    assert limit is not None
    owners.set_admission_filter(limit.filter(tokens))
    return owners


def drive(owners: Owners, steps: int) -> list[AuditRecord]:
    """Generates every dispatched group (scripted) and trains until ``steps`` steps are trained."""
    records = []
    owners.pump()
    while owners.trainer_step < steps:
        for d in owners.in_flight():
            owners.finish_group(d.group_id, rollouts(d))
        owners.begin_step()
        records.append(owners.commit_step())
        owners.pump()
    return records


def left(record: AuditRecord) -> list[tuple[int, str, str]]:
    return [(d.idx, d.state, d.reason) for d in record.dropped]


# ------------------------------------------------------------------------ the limit


def test_a_prompt_fits_when_it_and_max_new_tokens_fill_the_context_exactly() -> None:
    assert LIMIT.refusal(192) is None
    assert LIMIT.refusal(193) == "prompt_too_long: 193 tokens + maxNewTokens 64 > maxModelLen 256"


def test_the_limit_is_max_model_len_else_the_models_positions_else_none() -> None:
    assert prompt_limit(256, 64, 1024) == PromptLimit(256, 64)
    by_model = prompt_limit(None, 64, 1024)
    assert by_model == PromptLimit(1024, 64, MODEL_POSITIONS)
    assert by_model.refusal(961) == (
        "prompt_too_long: 961 tokens + maxNewTokens 64 > the model's max_position_embeddings 1024"
    )
    assert prompt_limit(None, 64, None) is None


def test_the_recovery_config_keeps_the_limit_and_leaves_old_configs_as_they_were() -> None:
    cfg = config()
    assert RecoveryConfig.from_json(cfg.to_json()) == cfg
    assert cfg.prompt_limit == LIMIT
    plain = RecoveryConfig(group_size=2, prompts_per_step=4, lookahead=0)
    assert "max_model_len" not in plain.to_json(), "cuts of runs without a limit stay byte for byte the same"
    assert plain.prompt_limit is None


def test_the_filtered_state_round_trips_and_the_default_is_not_written() -> None:
    filtered = DroppedPrompt("g3", 9, "arith", "prompt_too_long: ...", FILTERED)
    assert DroppedPrompt.from_json(filtered.to_json()) == filtered
    dropped = DroppedPrompt("g4", 2, "arith", "generation failed")
    assert "state" not in dropped.to_json()
    with pytest.raises(RecordFormatError, match="state is 'lost'"):
        DroppedPrompt.from_json(dropped.to_json() | {"state": "lost"})


# --------------------------------------------------------------------- admission


def test_shrink_filters_the_long_prompt_at_admission_and_the_step_trains_on_the_rest() -> None:
    owners = filtering(config(min_step_fraction=0.5))
    sent = owners.pump()
    assert [d.prompt.idx for d in sent] == [0, 2, 3], "row 1 never reaches generation"
    (record,) = drive(owners, 1)
    assert record.idxs == (0, 2, 3)
    assert left(record) == [(1, FILTERED, "prompt_too_long: 300 tokens + maxNewTokens 64 > maxModelLen 256")]
    # Row 1, then rows 5 and 6 when step 1 was admitted after the commit.
    assert (owners.counters.prompts_filtered, owners.counters.prompts_dropped) == (3, 0)
    acc = summarize([record.to_json()])
    assert (acc.prompts_trained, acc.prompts_filtered, acc.prompts_dropped, acc.prompts_lost) == (3, 1, 0, 0)
    assert "promptsFiltered           1" in format_summary(acc)


def test_shrink_below_min_step_fraction_raises_and_changes_nothing() -> None:
    # Step 1 holds rows 4-7: two long ones would leave 2 of 4 groups, below 0.75.
    owners = filtering(config(min_step_fraction=0.75))
    drive(owners, 0)
    for d in owners.in_flight():
        owners.finish_group(d.group_id, rollouts(d))
    owners.begin_step()
    owners.commit_step()
    before = owners.capture()
    with pytest.raises(StepTooSmallError, match=r"filtering group g5 \(idx 5, prompt_too_long.*\) and 1 more") as err:
        owners.pump()
    assert "raise spec.generation.maxModelLen" in str(err.value)
    after = owners.capture()
    assert (after.dispatch_index, after.ledger, after.dropped) == (before.dispatch_index, before.ledger, before.dropped)


def test_replace_fills_the_place_with_a_spare_of_the_same_step_and_version() -> None:
    # Spares are rows 4-7 (taken before the first admission); row 5 and 6 are long too: the
    # filtered row 1's place goes to row 4, the oldest spare.
    owners = filtering(config(on_dropped_prompt="replace", spare_pool_batches=1))
    sent = owners.pump()
    assert [(d.prompt.idx, d.target_step, d.weight_version) for d in sent] == [
        (0, 0, 0),
        (2, 0, 0),
        (3, 0, 0),
        (4, 0, 0),
    ]
    (record,) = drive(owners, 1)
    assert sorted(record.idxs) == [0, 2, 3, 4]
    assert [d[:2] for d in left(record)] == [(1, FILTERED)]


def test_replace_filters_a_long_spare_on_the_way_and_takes_the_next() -> None:
    # Step 1 stamps rows 8-11 (row 9 long); the pool holds 5, 6, 7 (row 4 went to step 0) then
    # 12-15: 5 and 6 are filtered at step 1, row 7 takes the place.
    owners = filtering(config(on_dropped_prompt="replace", spare_pool_batches=1))
    records = drive(owners, 2)
    assert sorted(records[1].idxs) == [7, 8, 10, 11]
    assert left(records[1])[0][:2] == (9, FILTERED)
    assert sorted(i for i, state, _ in left(records[1])) == [5, 6, 9]
    assert (owners.counters.prompts_filtered, owners.counters.replace_fallbacks) == (4, 0)


def test_a_dropped_group_is_replaced_by_the_first_spare_the_filter_admits() -> None:
    owners = filtering(config(on_dropped_prompt="replace", spare_pool_batches=1))
    sent = owners.pump()  # row 4 took row 1's place: the pool holds 5, 6, 7
    (spare,) = owners.drop_group(sent[0].group_id, "generation failed")
    assert spare.prompt.idx == 7, "5 and 6 are too long: filtered on the way"
    assert (owners.counters.prompts_dropped, owners.counters.prompts_filtered) == (1, 3)


def test_a_drop_with_only_long_spares_left_shrinks_the_step() -> None:
    cfg = config(on_dropped_prompt="replace", spare_pool_batches=1, prompts_per_step=2, min_step_fraction=0.5)
    owners = new_owners(cfg, size=40)
    owners.set_admission_filter(lambda p: "too long" if p.idx in (1, 3) else None)
    sent = owners.pump()  # step 0: rows 0 and 1; spares 2 and 3: row 2 takes row 1's place
    assert [d.prompt.idx for d in sent] == [0, 2]
    assert owners.drop_group(sent[0].group_id, "generation failed") == [], "the one spare left, row 3, is filtered"
    assert (owners.counters.replace_fallbacks, owners.counters.prompts_filtered) == (1, 2)
    owners.finish_group(sent[1].group_id, rollouts(sent[1]))
    assert [g.prompt.idx for g in owners.begin_step()] == [2]
    assert [(d.idx, d.state) for d in owners.commit_step().dropped] == [(1, FILTERED), (0, "dropped"), (3, FILTERED)]


def test_a_group_filtered_after_admission_ends_filtered_and_its_place_is_filled() -> None:
    """The move later filters reuse (dynamic sampling: after the rollouts, for another reason)."""
    owners = filtering(config(on_dropped_prompt="replace", spare_pool_batches=1))
    sent = owners.pump()
    owners.finish_group(sent[1].group_id, rollouts(sent[1])[:1], partial_ok=True)
    (spare,) = owners.filter_group(sent[1].group_id, "zero_advantage: every reward 1.0")
    assert (spare.prompt.idx, spare.target_step) == (7, 0), "5 and 6 are too long: filtered on the way"
    for d in owners.in_flight():
        owners.finish_group(d.group_id, rollouts(d))
    owners.begin_step()
    record = owners.commit_step()
    assert sorted(record.idxs) == [0, 3, 4, 7]
    assert left(record)[1] == (2, FILTERED, "zero_advantage: every reward 1.0")
    assert owners.counters.prompts_dropped == 0
    with pytest.raises(UnknownGroupError, match="cannot filter group"):
        owners.filter_group(sent[1].group_id, "again")


def test_a_run_with_a_limit_and_no_filter_refuses_to_admit() -> None:
    with pytest.raises(OwnershipError, match="no admission filter was set"):
        new_owners(config(), size=40).pump()


# ------------------------------------------------------------------ exactly once


@pytest.mark.parametrize("policy", ["shrink", "replace"])
def test_a_restore_filters_exactly_the_prompts_the_run_would_have(policy: str) -> None:
    """Owners restored from a snapshot taken after step 0 (step 1's long row 9 already filtered,
    a batch waiting at the gate), given the same filter, train the same stream with the same
    filtered prompts as the run never stopped."""
    cfg = config(on_dropped_prompt=policy, spare_pool_batches=1, min_step_fraction=0.25, lookahead=1)
    whole = drive(filtering(cfg), 5)

    owners = filtering(cfg)
    first = drive(owners, 1)
    snapshot = owners.capture()
    assert any(r.phase.value == "RESERVED" for r in snapshot.ledger), "a batch waits at the gate"
    loader = PromptLoader(ArithmeticDataset(size=40), PromptCollate(), batch_size=4, shuffle=False)
    restored = Owners.restore(snapshot, loader, attempt=1)
    restored.set_admission_filter(PromptLimit(256, 64).filter(tokens))
    rest = drive(restored, 5)

    def key(records: list[AuditRecord]) -> list[Any]:
        return [(r.step, r.group_ids, r.idxs, left(r)) for r in records]

    assert key(first + rest) == key(whole)
    filtered = {d.idx for r in whole for d in r.dropped if d.state == FILTERED}
    assert filtered == {1, 5, 6, 9}, filtered


def test_dispatches_never_carry_a_filtered_prompt() -> None:
    owners = filtering(config(on_dropped_prompt="replace", spare_pool_batches=2, lookahead=2))
    sent: list[Dispatch] = owners.pump()
    assert [tokens(d.prompt) for d in sent] == [10] * 12
