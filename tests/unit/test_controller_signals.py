"""What each SIGINT and SIGTERM does to a controller (spotrl_runtime.controller.signals)."""

from __future__ import annotations

import os
import signal
from typing import NoReturn

import pytest

from spotrl_runtime.controller.signals import SignalCount, StopSignals

INT, TERM = signal.SIGINT, signal.SIGTERM


@pytest.mark.parametrize(
    ("signals", "actions", "code"),
    [
        ([INT, INT, INT], ["stop", "warn", "abort"], 130),
        ([TERM, TERM, TERM], ["stop", "ignore", "ignore"], 143),
        ([TERM, INT, TERM, INT], ["stop", "warn", "ignore", "abort"], 143),
        ([INT, TERM, INT, INT], ["stop", "ignore", "warn", "abort"], 130),
        ([], [], 143),
    ],
)
def test_the_first_signal_stops_a_second_ctrl_c_warns_and_the_next_aborts(
    signals: list[int], actions: list[str], code: int
) -> None:
    count = SignalCount()
    assert [count.take(s) for s in signals] == actions
    assert count.exit_code() == code


class AbortedError(Exception):
    pass


def test_each_signal_says_what_it_does_and_the_controller_takes_over_the_stop(
    capsys: pytest.CaptureFixture[str],
) -> None:
    calls: list[str] = []

    def abort(code: int) -> NoReturn:
        raise AbortedError(code)

    signals = StopSignals(lambda name: calls.append(f"start-up {name}"), "stopping start-up", abort=abort)
    signals.stop_with(lambda name: calls.append(f"barrier {name}"), "taking a barrier cut, then stopping")
    signals.handle(TERM)
    signals.handle(TERM)
    signals.handle(INT)
    with pytest.raises(AbortedError) as aborted:
        signals.handle(INT)
    assert calls == ["barrier SIGTERM"], "only the first signal stops the run"
    assert aborted.value.args == (130,)
    assert capsys.readouterr().err.splitlines() == [
        "spotrl: SIGTERM: taking a barrier cut, then stopping (exit 143)",
        "spotrl: SIGTERM again: already stopping after SIGTERM (Ctrl-C twice more, or SIGKILL, stops at once)",
        "spotrl: cutting, press Ctrl-C again to abort: it stops at once, without this barrier cut "
        "(the last committed cut stands)",
        "spotrl: aborted: stopping now without a barrier cut (the last committed cut stands; exit 130)",
    ]


def test_installed_handlers_catch_both_signals() -> None:
    calls: list[str] = []
    before = {s: signal.getsignal(s) for s in (INT, TERM)}
    try:
        StopSignals(calls.append, "stopping").install()
        os.kill(os.getpid(), INT)
        os.kill(os.getpid(), TERM)  # a second signal: ignored, not the default (death)
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    assert calls == ["SIGINT"]
