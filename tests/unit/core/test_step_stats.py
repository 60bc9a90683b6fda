"""The per-step rollout statistics (core/step_stats.py) on groups whose numbers are known."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from spotrl_runtime.core.step_stats import STEP_STATS, BusyClock, LearningSignal, idle_shares, rollout_stats
from spotrl_runtime.core.types import FinishedGroup, Prompt, Rollout


def _group(gid: str, rows: list[tuple[float, int, str]]) -> FinishedGroup:
    rollouts = tuple(
        Rollout(gid, i, (1, 2), tuple(range(n)), (0.0,) * n, reward, 0, finish_reason=finish)
        for i, (reward, n, finish) in enumerate(rows)
    )
    return FinishedGroup(gid, Prompt(0, "t", "q", "a"), 0, rollouts)


def test_the_statistics_of_known_rollouts() -> None:
    groups = [
        _group("g0", [(1.0, 4, "stop"), (0.0, 8, "length")]),
        _group("g1", [(1.0, 2, "stop"), (0.5, 6, "stop")]),
    ]
    stats = rollout_stats(groups)
    assert set(stats) == set(STEP_STATS)
    assert stats["reward_mean"] == pytest.approx(0.625)
    assert stats["reward_std"] == pytest.approx(math.sqrt((0.375**2 * 2 + 0.625**2 + 0.125**2) / 4))
    assert stats["accuracy"] == 0.5, "a 0.5 is not a correct answer"
    assert stats["response_length_mean"] == 5.0
    assert stats["response_length_max"] == 8.0
    assert stats["response_clip_ratio"] == 0.25
    assert stats["frac_reward_zero_std"] == 0.0
    flat = [*groups, _group("g2", [(0.0, 3, "stop"), (0.0, 1, "stop")])]
    assert rollout_stats(flat)["frac_reward_zero_std"] == pytest.approx(1 / 3)


def test_episodes_count_their_turns_and_observation_tokens() -> None:
    group = _group("g0", [(1.0, 9, "stop"), (0.0, 4, "stop")])
    episode = replace(group.rollouts[0], observed=((2, 4), (6, 7)))
    stats = rollout_stats([replace(group, rollouts=(episode, group.rollouts[1]))])
    assert stats["turns_mean"] == 2.0, "three turns and one"
    assert stats["observation_tokens_mean"] == 1.5
    assert rollout_stats([group])["turns_mean"] == 1.0


def test_the_learning_signal_is_lost_after_patience_steps_without_variance_and_found_again() -> None:
    signal = LearningSignal(patience=3)
    said = [signal.observe(f) for f in (1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0)]
    assert said == [False, False, False, False, False, True, False], "said once, when the streak reaches 3"
    assert signal.lost
    assert signal.streak == 4
    signal.observe(0.9)
    assert not signal.lost
    assert signal.streak == 0


def test_no_rollouts_give_zeros_not_an_error() -> None:
    assert rollout_stats([]) == dict.fromkeys(STEP_STATS, 0.0)


def _clock(*marks: tuple[float, bool]) -> BusyClock:
    clock = BusyClock()
    for at, busy in marks:
        clock.mark(busy, at)
    return clock


def test_a_workers_busy_seconds_are_its_spans_cut_to_the_window() -> None:
    # Busy 1-3 and 5-6, then from 8 on (still busy when read).
    clock = _clock((1.0, True), (3.0, False), (5.0, True), (5.5, True), (6.0, False), (7.0, False), (8.0, True))
    assert clock.busy_seconds(0.0, 10.0) == pytest.approx(2.0 + 1.0 + 2.0)
    assert clock.busy_seconds(2.0, 5.5) == pytest.approx(1.0 + 0.5), "cut at both ends"
    assert clock.busy_seconds(6.0, 8.0) == 0.0
    assert clock.busy_seconds(9.0, 10.0) == pytest.approx(1.0), "the open span counts up to the window's end"
    assert list(clock.spans) == [], "spans that ended before the window asked for are forgotten"
    assert _clock((4.0, True), (4.0, False)).busy_seconds(0.0, 10.0) == 0.0, "an empty span is none"


def test_the_idle_share_is_the_mean_and_the_max_over_the_workers_of_the_time_not_generating() -> None:
    mean, most = idle_shares([10.0, 5.0, 0.0], 10.0)
    assert (mean, most) == (pytest.approx((0.0 + 0.5 + 1.0) / 3), 1.0)
    assert idle_shares([12.0], 10.0) == (0.0, 0.0), "clock skew never makes a share negative"
    assert idle_shares([], 10.0) == (0.0, 0.0)
    assert idle_shares([1.0], 0.0) == (0.0, 0.0)
