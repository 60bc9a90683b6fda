"""Fixtures of the trainer tests."""

from __future__ import annotations

import pytest
from training_helpers import make_group

from spotrl_runtime.core.types import FinishedGroup


@pytest.fixture
def groups() -> list[FinishedGroup]:
    """Three groups with reward variance, one without, of uneven lengths."""
    return [
        make_group("a", [1.0, 0.0, 0.0, 1.0]),
        make_group("b", [0.0, 0.0, 1.0, 0.0]),
        make_group("c", [1.0, 1.0, 1.0, 1.0]),
        make_group("d", [0.5, 0.25, 0.0, 1.0]),
    ]
