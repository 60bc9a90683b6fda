"""pytest fixtures for the test control plane. Register with ``pytest_plugins = ["spotrl_e2e.pytest_plugin"]``.

- ``s3_server`` (session): a running versitygw; ``s3_bucket`` (per test): a fresh bucket,
  an :class:`~spotrl_e2e.s3.S3Bucket` (``endpoint``, ``bucket``, keys, ``region``, ``client()``).
- ``fault_proxy`` (per test): a :class:`~spotrl_e2e.faultproxy.FaultProxy` (seed 0) in front of
  the S3 server; point a client at ``fault_proxy.endpoint`` and add rules to fail requests.
- ``cluster`` (per test, one cluster per session, started the first time a test asks): a
  :class:`~spotrl_e2e.cluster.Cluster` with nodes spot-a, spot-b (spot) and ondemand-a
  (on-demand), one fake GPU each; after each test its nodes are put back (restored,
  uncordoned, test taints removed). Tests that use it get the ``cluster`` marker.
- ``namespace`` (per test): a fresh namespace in that cluster, deleted afterwards.

``SPOTRL_E2E_CLUSTER_DIR=<dir>`` runs the tests against a cluster ``make cluster-up``
started there instead of starting one (quicker while iterating; it is left running).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotrl_e2e.cluster import Cluster
from spotrl_e2e.faultproxy import FaultProxy
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


@pytest.fixture
def fault_proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    """A fault-injecting proxy in front of the S3 server (no rules yet: it forwards everything)."""
    proxy = FaultProxy(s3_server.endpoint, seed=0)
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.fixture(scope="session")
def spotrl_cluster_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The session's cluster (use ``cluster``, which also resets the nodes after each test)."""
    existing = os.environ.get("SPOTRL_E2E_CLUSTER_DIR")
    if existing:
        yield Cluster.attach(Path(existing))
        return
    cluster = Cluster(tmp_path_factory.mktemp("cluster")).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster(spotrl_cluster_session: Cluster) -> Iterator[Cluster]:
    """The running test cluster; its nodes are put back as they started after the test."""
    yield spotrl_cluster_session
    spotrl_cluster_session.reset_nodes()


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace named after the test; deleted (not waited for) afterwards."""
    prefix = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower().removeprefix("test_")).strip("-")
    name = cluster.create_namespace(prefix or "test")
    yield name
    cluster.delete_namespace(name)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        names = getattr(item, "fixturenames", ())
        if "cluster" in names or "spotrl_cluster_session" in names:
            item.add_marker(pytest.mark.cluster)
        if "s3_server" in names:
            item.add_marker(pytest.mark.s3)
