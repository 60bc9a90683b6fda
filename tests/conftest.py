"""Fixtures shared by every test folder: the S3 server and the test control plane (see
docs/development/test-control-plane.md), and one short folder for the Ray files (and vLLM's
caches) of every process the tests start."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins = ["spotrl_e2e.pytest_plugin"]


@pytest.fixture(scope="session", autouse=True)
def ray_tmp() -> Iterator[Path]:
    """``SPOTRL_RAY_TMP`` of the controllers and worker nodes the tests start: one folder for
    the session, short because Ray's socket paths must fit in 107 bytes (a test's tmp_path may
    not), and removed at the end with whatever a SIGKILLed process could not remove itself.
    ``SPOTRL_TEST_RAY_TMP`` picks another parent folder for it."""
    parent = os.environ.get("SPOTRL_TEST_RAY_TMP", "/tmp")
    folder = Path(tempfile.mkdtemp(prefix="spotrl-ray-", dir=parent))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPOTRL_RAY_TMP", str(folder))
        mp.setenv("SPOTRL_TEST_RAY_TMP", str(folder))
        # vLLM's caches (its model inspection: one subprocess per architecture, slow) and
        # config: one folder for the session's engines, none in $HOME.
        mp.setenv("VLLM_CACHE_ROOT", str(folder / "vllm-cache"))
        mp.setenv("VLLM_CONFIG_ROOT", str(folder / "vllm-config"))
        yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def crash_stacks() -> Iterator[None]:
    """Every Python process the tests start prints its threads' stacks to its log if it
    crashes (SIGSEGV, SIGABRT...): a run's log is in its test's failure, so a crash in CI says
    where (pytest itself does this for its own process)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONFAULTHANDLER", "1")
        yield
