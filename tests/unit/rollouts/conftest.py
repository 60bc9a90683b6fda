"""The turn loop's tests share one small ChatML tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from spotrl_e2e import scripted_engine


@pytest.fixture(scope="session")
def chat_tokenizer() -> Any:
    return scripted_engine.chat_tokenizer()
