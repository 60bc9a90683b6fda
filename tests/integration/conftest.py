"""Shared by the integration tests: one real Ray runtime for the whole session (each start costs
seconds and memory), shut down at the end."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def ray_session() -> Iterator[Any]:
    """``ray`` initialised locally: 2 CPUs, no dashboard, its files under a short temp path."""
    import ray

    # The demo model is built once here, not concurrently by the first workers.
    from spotrl_runtime.models import resolve_model_dir

    resolve_model_dir("builtin:tiny-arith")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Unix socket paths must stay under ~107 bytes: pytest's tmp paths are too long.
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=temp_dir,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
    )
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
