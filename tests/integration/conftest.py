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
def _ray_folders() -> Iterator[list[str]]:
    """The temp folders of the session's Ray runtimes; Ray shut down and they removed at the end."""
    folders: list[str] = []
    yield folders
    import ray

    ray.shutdown()
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_session(_ray_folders: list[str]) -> Any:
    """``ray`` initialised locally: 2 CPUs, no dashboard, its files under a short temp path. One
    runtime serves every module while it runs; a module that shuts it down (test_gpu_placement
    gives each example a cluster of its own) leaves the next module that needs it to start it again."""
    import ray

    if ray.is_initialized():
        return ray
    # The demo model is built once here, not concurrently by the first workers.
    from spotrl_runtime.models import resolve_model_dir

    resolve_model_dir("builtin:tiny-arith")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Unix socket paths must stay under ~107 bytes: pytest's tmp paths are too long.
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    _ray_folders.append(temp_dir)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=temp_dir,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
    )
    return ray
