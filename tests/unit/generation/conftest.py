"""The demo policy, loaded once per session, for the generation tests."""

from __future__ import annotations

from typing import Any

import pytest

from spotrl_runtime.models import load_policy


@pytest.fixture(scope="session")
def tiny_arith() -> tuple[Any, Any]:
    """(model, tokenizer) of builtin:tiny-arith, built into the model cache on first use."""
    return load_policy("builtin:tiny-arith")
