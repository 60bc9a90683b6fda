"""The barrier cut estimate (core/cut_estimate.py): bytes over recent throughput plus the
largest fixed part, and whether it fits the shortest window, with what would fit."""

from __future__ import annotations

import pytest

from spotrl_runtime.core.cut_estimate import BUSY_RISK, HEADROOM, CutEstimate, CutEstimator, assess

MB = 1_000_000


def feed(est: CutEstimator, *cuts: tuple[int, float, float, int, float]) -> CutEstimate | None:
    """Each cut: (bytes, seconds, files seconds, step, commit time)."""
    out = None
    for size, seconds, files, step, at in cuts:
        out = est.add_cut(kind="periodic", bytes=size, seconds=seconds, timings={"files": files}, step=step, at=at)
    return out


def test_no_estimate_before_a_cut_with_bytes() -> None:
    est = CutEstimator()
    assert est.estimate() is None
    assert est.add_cut(kind="periodic", bytes=0, seconds=1.0, timings={}, step=0, at=0.0) is None


def test_one_cut_gives_its_own_time_for_its_size() -> None:
    e = feed(CutEstimator(), (100 * MB, 2.5, 2.0, 5, 100.0))
    assert e is not None
    assert e.bytes_per_second == pytest.approx(50 * MB)
    assert e.overhead_seconds == pytest.approx(0.5)
    assert e.seconds == pytest.approx(2.5)
    assert e.based_on_cuts == 1
    assert e.step_seconds is None


def test_the_newest_size_over_the_pooled_throughput_plus_the_largest_fixed_part() -> None:
    e = feed(
        CutEstimator(),
        (100 * MB, 1.2, 1.0, 5, 100.0),  # 100 MB/s, 0.2 s fixed
        (100 * MB, 3.5, 3.0, 10, 150.0),  # a slow one: 33 MB/s, 0.5 s fixed
        (200 * MB, 2.1, 2.0, 15, 200.0),  # the state doubled
    )
    assert e is not None
    assert e.bytes == 200 * MB
    assert e.bytes_per_second == pytest.approx(400 * MB / 6.0, rel=1e-3)
    assert e.overhead_seconds == pytest.approx(0.5)
    assert e.seconds == pytest.approx(0.5 + 200 * MB / (400 * MB / 6.0), rel=1e-3)
    assert e.step_seconds == pytest.approx(10.0)
    assert e.based_on_cuts == 3


def test_a_store_that_slowed_down_counts_at_once_and_only_recent_cuts_count() -> None:
    est = CutEstimator(recent=3)
    fast = feed(est, *[(100 * MB, 1.0, 1.0, 5 * i, 10.0 * i) for i in range(1, 6)])
    assert fast is not None
    assert fast.seconds == pytest.approx(1.0)
    slow = feed(est, (100 * MB, 10.0, 10.0, 30, 60.0))
    assert slow is not None
    assert slow.seconds == pytest.approx(10.0), "the newest cut's own speed, not the pooled 4 s"
    # Fast again: the slow cut still weighs on the pooled throughput until it is out of the recent three.
    again = feed(est, (100 * MB, 1.0, 1.0, 35, 70.0))
    assert again is not None
    assert again.seconds == pytest.approx(4.0)
    later = feed(est, (100 * MB, 1.0, 1.0, 40, 80.0), (100 * MB, 1.0, 1.0, 45, 90.0))
    assert later is not None
    assert later.seconds == pytest.approx(1.0)
    assert later.based_on_cuts == 3


def test_a_cut_without_file_timings_counts_wholly_as_transfer() -> None:
    e = CutEstimator().add_cut(kind="barrier", bytes=10 * MB, seconds=2.0, timings={}, step=1, at=1.0)
    assert e is not None
    assert e.bytes_per_second == pytest.approx(5 * MB)
    assert e.overhead_seconds == 0.0
    assert e.seconds == pytest.approx(2.0)


def _est(seconds: float, *, size: int = 100 * MB, overhead: float = 1.0, step: float | None = 2.0) -> CutEstimate:
    return CutEstimate(
        seconds=seconds,
        bytes=size,
        bytes_per_second=size / (seconds - overhead),
        overhead_seconds=overhead,
        based_on_cuts=3,
        step_seconds=step,
    )


def test_an_estimate_within_the_headroom_fits() -> None:
    a = assess(_est(15.9), 20, every_steps=100, every_seconds=0, window_source="gke's cap")
    assert not a.at_risk
    assert a.busy_share == pytest.approx(15.9 / 200)
    assert a.budget_seconds == pytest.approx(20 * HEADROOM)
    assert "15.9 s" in a.message
    assert "20 s (gke's cap)" in a.message


def test_over_the_headroom_is_at_risk_with_the_loss_and_what_would_fit() -> None:
    a = assess(_est(21.0), 20, every_steps=50, every_seconds=0, window_source="gke's cap")
    assert a.at_risk
    assert "21.0 s" in a.message
    assert "20 s (gke's cap)" in a.message
    assert "everySteps=50 steps (~100 s)" in a.message, a.message
    # 16 s of budget, 1 s fixed: 100 MB in 15 s.
    assert "at least 6.7 MB/s" in a.message, a.message
    # A periodic cut every ceil(21 / 2) = 11 steps is as often as the store takes them.
    assert a.every_steps_to_fit == 11
    assert "set checkpoint.everySteps to 11 to lose at most 11 step(s) (~22 s)" in a.message


def test_no_cadence_advice_when_periodic_cuts_are_already_that_frequent() -> None:
    a = assess(_est(21.0), 20, every_steps=5, every_seconds=0)
    assert a.at_risk
    assert a.every_steps_to_fit is None
    assert "set checkpoint.everySteps" not in a.message


def test_a_fixed_part_over_the_budget_asks_for_a_faster_store_not_a_throughput() -> None:
    a = assess(_est(30.0, overhead=17.0), 20, every_steps=0, every_seconds=60)
    assert a.at_risk
    assert "less than 16.0 s of fixed cost (now 17.0 s)" in a.message
    assert "everySeconds=60 s" in a.message
    assert a.every_steps_to_fit == 15


def test_without_a_step_time_there_is_no_cadence_advice() -> None:
    a = assess(_est(30.0, step=None), 20, every_steps=10, every_seconds=0)
    assert a.at_risk
    assert a.every_steps_to_fit is None
    assert "everySteps=10 steps of" in a.message


def test_a_barrier_that_fits_alone_is_at_risk_behind_frequent_periodic_cuts() -> None:
    """One writer: a barrier that finds a periodic cut being written waits for it."""
    a = assess(_est(9.0), 20, every_steps=3, every_seconds=0)  # a 9 s cut every 6 s: always busy
    assert a.at_risk
    assert a.busy_share == 1.0
    assert a.worst_seconds == pytest.approx(18.0)
    assert "within 16.0 s" in a.message
    assert "busy with periodic cuts ~100% of the time" in a.message
    assert "up to 18.0 s" in a.message
    # Rarely enough that the writer is busy under 10% of the time: 9 s / (0.1 * 2 s) = 45 steps.
    assert a.every_steps_to_fit == 45
    assert f"checkpoint.everySteps=45 keeps the writer busy under {BUSY_RISK:.0%}" in a.message
    # 8 s (half the budget) minus 1 s fixed for 100 MB.
    assert "at least 14.3 MB/s" in a.message


def test_a_writer_seldom_busy_does_not_count_the_wait_but_says_it() -> None:
    a = assess(_est(9.0), 20, every_steps=50, every_seconds=0)  # 9 s every 100 s: 9% busy
    assert not a.at_risk
    assert a.busy_share == pytest.approx(0.09)
    assert "up to 18.0 s" in a.message


def test_every_seconds_counts_for_the_busy_share() -> None:
    a = assess(_est(9.0, step=None), 20, every_steps=0, every_seconds=30)
    assert a.at_risk
    assert a.busy_share == pytest.approx(0.3)


def test_a_trainer_group_barrier_waits_for_its_step_so_a_step_counts_as_fixed() -> None:
    cuts = [(100 * MB, 1.2, 1.0, 5, 100.0), (100 * MB, 1.2, 1.0, 10, 150.0)]  # 10 s a step
    alone = feed(CutEstimator(), *cuts)
    group = feed(CutEstimator(waits_for_step=True), *cuts)
    assert alone is not None
    assert group is not None
    assert alone.seconds == pytest.approx(1.2)
    assert group.overhead_seconds == pytest.approx(0.2 + 10.0)
    assert group.seconds == pytest.approx(11.2)
    first = feed(CutEstimator(waits_for_step=True), cuts[0])
    assert first is not None
    assert first.seconds == pytest.approx(1.2), "no step time known yet"
