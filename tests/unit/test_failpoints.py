"""Failpoints: fire once, at the named step only, mark their arrival, and end early on release."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from spotrl_runtime import failpoints


@pytest.fixture
def points(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setattr(failpoints, "_spec", None)
    monkeypatch.setenv("SPOTRL_FAILPOINT_DIR", str(tmp_path))
    return tmp_path


def test_fires_once_at_its_step_and_marks_arrival(points: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTRL_FAILPOINTS", "train.step@3=0.01")
    failpoints.failpoint("train.step", 2)
    assert not (points / "train.step").exists()
    failpoints.failpoint("train.step", 3)
    assert json.loads((points / "train.step").read_text()) == {"step": 3, "pid": os.getpid()}
    (points / "train.step").unlink()
    failpoints.failpoint("train.step", 3)
    assert not (points / "train.step").exists(), "a point fires once"


def test_onward_fires_at_the_first_step_from_n_on(points: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTRL_FAILPOINTS", "worker.generate@5+=0.01")
    failpoints.failpoint("worker.generate", 4)
    failpoints.failpoint("worker.generate", None)
    assert not (points / "worker.generate").exists()
    failpoints.failpoint("worker.generate", 7)
    assert json.loads((points / "worker.generate").read_text())["step"] == 7


def test_release_file_ends_the_hold_early(points: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTRL_FAILPOINTS", "dispatch.finish@1=60")
    timer = threading.Timer(0.3, lambda: (points / "dispatch.finish.release").touch())
    timer.start()
    started = time.monotonic()
    failpoints.failpoint("dispatch.finish", 1)
    held = time.monotonic() - started
    timer.cancel()
    assert (points / "dispatch.finish").exists()
    assert 0.25 <= held < 10, held


def test_unnamed_points_cost_nothing(points: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTRL_FAILPOINTS", "cut.captured=30")
    started = time.monotonic()
    failpoints.failpoint("train.step", 1)
    assert time.monotonic() - started < 1
    assert list(points.iterdir()) == []
