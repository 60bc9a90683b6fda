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


@pytest.fixture(scope="session")
def _ray_forkserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The warm parent the session's Ray forks its workers from (:mod:`spotrl_e2e.forkserver`:
    each generation worker or trainer rank then starts with torch and transformers loaded);
    None where ``SPOTRL_TEST_FORKSERVER`` or ``SPOTRL_TEST_FORKSERVER_RAY`` is 0."""
    from spotrl_e2e.forkserver import FORK_RAY_VAR, FORK_VAR, ForkServer

    if "0" in (os.environ.get(FORK_VAR), os.environ.get(FORK_RAY_VAR)):
        yield None
        return
    server = ForkServer(dict(os.environ), tmp_path_factory.mktemp("ray-forkserver"), ray_workers=True)
    yield server
    server.close()


@pytest.fixture(scope="module")
def ray_session(_ray_folders: list[str], _ray_forkserver: Any) -> Any:
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
    # With a job-wide runtime_env, Ray's runtime-env agent starts each worker with the env's
    # py_executable: the fork server's launcher, which forks Ray's worker (each generation
    # worker or trainer rank then starts with torch and transformers loaded).
    runtime_env: dict[str, Any] = {"env_vars": {"OMP_NUM_THREADS": "1"}}
    if _ray_forkserver is not None:
        runtime_env["py_executable"] = _ray_forkserver.python
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=temp_dir,
        log_to_driver=False,
        configure_logging=False,
        runtime_env=runtime_env,
    )
    return ray
