"""pytest fixtures for the test control plane. Register with ``pytest_plugins = ["spotrl_e2e.pytest_plugin"]``.

- ``s3_server`` (session): a running versitygw; ``s3_bucket`` (per test): a fresh bucket,
  an :class:`~spotrl_e2e.s3.S3Bucket` (``endpoint``, ``bucket``, keys, ``region``, ``client()``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from spotrl_e2e.s3 import S3Bucket, S3Server


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One S3 server for the whole session, started the first time a test asks for it."""
    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> Iterator[S3Bucket]:
    """A fresh, empty bucket for one test; emptied and deleted afterwards."""
    bucket = s3_server.create_bucket()
    try:
        yield bucket
    finally:
        s3_server.delete_bucket(bucket)
