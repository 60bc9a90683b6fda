"""Fixtures for the controller tests: one model cache and one uninterrupted baseline run."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from controller_runs import Runs, stream


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    r = Runs(tmp_path_factory.mktemp("runs"))
    yield r
    r.close()


@pytest.fixture(scope="session")
def baseline(runs: Runs) -> list[tuple[int, list[int]]]:
    """The effective stream of the tiny job run once, never stopped."""
    storage = runs.base / "baseline"
    rc, log = runs.run(runs.job(), storage)
    assert rc == 0, log
    assert "Ray and the generation pool started in" in log, "started on a thread, beside the imports"
    assert "SIGTERM handler is not set" not in log, "Ray's note about that thread is filtered"
    got = stream(storage)
    assert [s for s, _ in got] == list(range(16))
    return got
