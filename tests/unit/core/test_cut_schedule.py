"""The periodic cuts' cadence (core/cut_schedule.py) and which cuts retention keeps
(checkpoint/writer.py: kept_chains): pure functions of steps, seconds and manifests."""

from __future__ import annotations

from spotrl_runtime.checkpoint.writer import kept_chains
from spotrl_runtime.core.cut_schedule import CutSchedule


def schedule(
    every_steps: int = 5, every_seconds: float = 0, delta_steps: int = 1, delta_seconds: float = 0, based: bool = False
) -> CutSchedule:
    return CutSchedule(every_steps, every_seconds, delta_steps, delta_seconds, 0.0, 0.0, 0, based=based)


def run(s: CutSchedule, steps: int) -> list[tuple[int, str]]:
    """The cuts a controller takes over ``steps`` steps, as (trainer step, form)."""
    cuts: list[tuple[int, str]] = []
    for step in range(steps):
        if s.at_ready() is not None:  # the next step's groups are ready
            cuts.append((step, "full"))
            s.taken("full", step, float(step))
        if s.after_step(step + 1) is not None:
            cuts.append((step + 1, "delta"))
            s.taken("delta", step + 1, float(step + 1))
    return cuts


def test_a_delta_after_every_step_between_full_cuts_and_a_first_full_cut_to_extend() -> None:
    cuts = run(schedule(every_steps=5, delta_steps=1), 11)
    assert cuts == [
        (0, "full"),  # a new run: the deltas need a full cut to extend
        (1, "delta"), (2, "delta"), (3, "delta"), (4, "delta"),
        (5, "full"),  # due after step 5's commit, captured once step 5's groups are ready
        (6, "delta"), (7, "delta"), (8, "delta"), (9, "delta"),
        (10, "full"),
        (11, "delta"),
    ]  # fmt: skip


def test_every_other_step_and_off() -> None:
    assert [c for c in run(schedule(every_steps=4, delta_steps=2), 8) if c[1] == "delta"] == [
        (2, "delta"),
        (6, "delta"),
    ]
    assert run(schedule(every_steps=4, delta_steps=0), 9) == [(4, "full"), (8, "full")], "no deltas: no first full cut"


def test_seconds_mark_a_full_cut_due_and_take_deltas_while_waiting() -> None:
    s = schedule(every_steps=0, every_seconds=60, delta_steps=0, delta_seconds=10, based=True)
    assert s.while_waiting(5.0) is None
    assert s.while_waiting(10.0) == "every 10 s, delta"
    s.taken("delta", 3, 10.0)
    assert s.while_waiting(15.0) is None
    unbased = schedule(every_steps=0, every_seconds=60, delta_steps=0, delta_seconds=10)
    assert unbased.while_waiting(20.0) is None, "nothing to extend"
    assert s.while_waiting(61.0) is None, "a full cut is due instead"
    assert s.at_ready() == "every 60 s"
    s.taken("full", 4, 62.0)
    assert s.at_ready() is None
    assert s.while_waiting(72.0) == "every 10 s, delta"


def test_retention_keeps_chains_not_cuts() -> None:
    committed = ["1", "2", "3", "4", "5", "6", "7"]
    bases = {"1": None, "2": "1", "3": "1", "4": None, "5": "4", "6": None, "7": "6"}
    assert kept_chains(committed, bases, 1, "6") == {"6", "7"}
    assert kept_chains(committed, bases, 2, "6") == {"4", "5", "6", "7"}
    # A resumed run extends an older base than the newest full cut: that chain stays too.
    assert kept_chains(committed, bases, 1, "4") == {"4", "5", "6", "7"}
    # A delta whose base is gone is no chain's.
    assert kept_chains(["2", "4"], {"2": "1", "4": None}, 3, None) == {"4"}
