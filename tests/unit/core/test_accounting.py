"""Exactly-once, counted from the audit and the restore records."""

from __future__ import annotations

from typing import Any

import pytest

from spotrl_runtime.core.accounting import RestoreRecord, format_summary, summarize


def doc(step: int, attempt: int, groups: list[str], at: float | None = None, dropped: tuple[str, ...] = ()) -> Any:
    d: dict[str, Any] = {
        "step": step,
        "attempt": attempt,
        "weight_version": step + 1,
        "group_ids": groups,
        "idxs": list(range(len(groups))),
        "task_names": ["t"] * len(groups),
        "dropped": [{"group_id": g, "idx": 0, "task_name": "t", "reason": "failed"} for g in dropped],
    }
    if at is not None:
        d["at"] = at
    return d


def test_an_abrupt_loss_retrains_and_loses_nothing() -> None:
    # Attempt 1 trained steps 0-3; its cut was at step 2 (committed at t=100). Attempt 2
    # resumed from it and trained steps 2 and 3 again, on the same groups, then step 4.
    docs = [
        doc(0, 1, ["g0", "g1"], 10),
        doc(1, 1, ["g2", "g3"], 20),
        doc(2, 1, ["g4", "g5"], 101),
        doc(3, 1, ["g6", "g7"], 110),
        doc(2, 2, ["g5", "g4"], 160),
        doc(3, 2, ["g6", "g7"], 170),
        doc(4, 2, ["g8"], 180, dropped=("g9",)),
    ]
    restores = [RestoreRecord(2, "c2", 2, cut_committed_at=100.0, groups_redispatched=3, siblings_reused=5)]
    acc = summarize(docs, restores)
    assert acc.prompts_trained == 9
    assert acc.prompts_dropped == 1
    assert acc.prompts_lost == 0
    assert acc.prompts_trained_twice == 0
    assert acc.steps_missing == 0
    assert acc.steps_retrained == 2
    assert (acc.groups_redispatched, acc.siblings_reused, acc.restores) == (3, 5, 1)
    assert acc.seconds_lost_per_preemption == [60.0]


def test_a_prompt_lost_and_one_trained_twice_are_counted() -> None:
    docs = [
        doc(0, 1, ["g0", "g1"]),
        doc(1, 1, ["g2", "g3"]),
        doc(1, 2, ["g2", "g1"]),  # g3 never trained again: lost; g1 trained in steps 0 and 1
        doc(3, 2, ["g4"]),  # step 2 has no record
    ]
    acc = summarize(docs)
    assert acc.prompts_lost == 1
    assert acc.prompts_trained_twice == 1
    assert acc.steps_missing == 1
    assert acc.steps_retrained == 1
    assert acc.seconds_lost_per_preemption == []
    text = format_summary(acc)
    assert "promptsLost" in text
    assert "promptsTrainedTwice" in text


def test_a_dropped_prompt_is_not_lost() -> None:
    docs = [doc(0, 1, ["g0", "g1"]), doc(0, 2, ["g0"], dropped=("g1",))]
    acc = summarize(docs)
    assert acc.prompts_lost == 0
    assert acc.prompts_dropped == 1


def test_seconds_lost_need_both_times_and_keep_the_newest() -> None:
    docs = [doc(0, a, [f"g{a}"], at=1000.0 * a) for a in range(1, 80)]
    restores = [RestoreRecord(a, f"c{a}", 0, cut_committed_at=1000.0 * a - 7) for a in range(2, 80)]
    restores.append(RestoreRecord(90, "c90", 0, cut_committed_at=5.0))  # no step trained: not counted
    acc = summarize(docs, restores)
    assert acc.restores == 79
    assert len(acc.seconds_lost_per_preemption) == 64
    assert set(acc.seconds_lost_per_preemption) == {7.0}


def test_the_rollout_gap_is_read_from_the_effective_stream_only() -> None:
    from spotrl_runtime.core.accounting import rollout_gap

    def measured(d: Any, mean: float, peak: float, tokens: int) -> Any:
        return d | {
            "rollout_probs_diff_mean": mean,
            "rollout_probs_diff_max": peak,
            "rollout_probs_diff_tokens": tokens,
        }

    docs = [
        measured(doc(0, 1, ["g0"]), 0.01, 0.02, 10),
        measured(doc(1, 1, ["g1"]), 0.9, 0.99, 10),  # attempt 1's step 1, trained again by attempt 2
        measured(doc(1, 2, ["g1"]), 0.03, 0.05, 30),
        doc(2, 2, ["g2"]),  # not measured (generated ahead)
    ]
    gap = rollout_gap(docs)
    assert (gap.steps, gap.tokens) == (2, 40)
    assert gap.mean == pytest.approx((0.01 * 10 + 0.03 * 30) / 40)
    assert gap.max == 0.05
    text = format_summary(summarize(docs), gap)
    assert text.splitlines()[-2:] == [
        "rolloutProbsDiffMean      0.025 (2 steps, 40 tokens)",
        "rolloutProbsDiffMax       0.05",
    ]
    assert rollout_gap([doc(0, 1, ["g0"])]).steps == 0


def test_a_delta_resume_redoes_steps_without_retraining_them() -> None:
    # Attempt 1 trained steps 0-3; its delta cut at step 4 extends the full cut of step 2, so
    # attempt 2 redid steps 2 and 3 from their rows (no audit record) and trained step 4.
    docs = [doc(s, 1, [f"g{2 * s}", f"g{2 * s + 1}"], 10.0 * s) for s in range(4)] + [doc(4, 2, ["g8", "g9"], 90)]
    restores = [RestoreRecord(2, "c3", 4, cut_committed_at=50.0, cut_form="delta", steps_redone=2)]
    acc = summarize(docs, restores)
    assert (acc.steps_redone, acc.steps_retrained, acc.prompts_trained_twice) == (2, 0, 0)
    assert "stepsRedone" in format_summary(acc)
    assert RestoreRecord.from_json(restores[0].to_json()) == restores[0]
    old = {k: v for k, v in restores[0].to_json().items() if k not in ("cut_form", "steps_redone")}
    assert (RestoreRecord.from_json(old).cut_form, RestoreRecord.from_json(old).steps_redone) == ("full", 0)
