"""The turn loop's tests share one small ChatML tokenizer."""

from __future__ import annotations

from typing import Any

import pytest
import rollout_helpers


@pytest.fixture(scope="session")
def chat_tokenizer() -> Any:
    return rollout_helpers.chat_tokenizer()
