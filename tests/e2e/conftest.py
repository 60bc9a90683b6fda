"""Fixtures of the operator tests: the CRD, the chart's operator identity, a running operator,
and the RLJobs of one test (deleted through the operator's finalizer afterwards)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from operator_harness import (
    TARGET,
    Jobs,
    JobStorage,
    OperatorProcess,
    apply_crd,
    install_operator_identity,
    kind_bucket,
)

from spotrl_e2e.cluster import Cluster


@pytest.fixture(scope="module")
def operator_identity(
    spotrl_cluster_session: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    """(namespace, kubeconfig) of the chart's operator ServiceAccount, fresh for the module."""
    cluster = spotrl_cluster_session
    apply_crd(cluster)
    namespace = cluster.create_namespace("spotrl-system")
    kubeconfig = install_operator_identity(cluster, namespace, tmp_path_factory.mktemp("operator"))
    yield namespace, kubeconfig
    cluster.delete_namespace(namespace)


@pytest.fixture
def start_operator(
    cluster: Cluster, operator_identity: tuple[str, Path], tmp_path: Path
) -> Iterator[Callable[..., OperatorProcess]]:
    """Starts operators (``start_operator(args=(...), wait="lead"|"standby")``); all are
    stopped at the end of the test. ``kubeconfig``: another token of the chart's ServiceAccount
    (one per operator, so the API server's audit log tells them apart); ``env``: variables added."""
    namespace, module_kubeconfig = operator_identity
    started: list[OperatorProcess] = []

    def start(
        args: tuple[str, ...] = (),
        wait: str | None = "lead",
        name: str = "operator",
        source: Path | None = None,
        kubeconfig: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> OperatorProcess:
        config = kubeconfig or module_kubeconfig
        op = OperatorProcess(cluster, config, namespace, tmp_path, name=name, args=args, source=source, env=env)
        started.append(op)
        return op.start(wait=wait)

    yield start
    for op in reversed(started):
        op.stop()


@pytest.fixture
def operator(start_operator: Callable[..., OperatorProcess]) -> OperatorProcess:
    """One operator, leading, for this test."""
    return start_operator()


@pytest.fixture
def jobs(cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]) -> Iterator[Jobs]:
    """The test's RLJobs; deleted at the end while its operators still run (their finalizer)."""
    j = Jobs(cluster, namespace)
    yield j
    j.cleanup()


# ----------------------------------------------------------------------------- the e2e target
# SPOTRL_E2E_TARGET=kind (set by e2e/kind/run.sh): the end-to-end tests run on a kind
# cluster where the chart is installed and an S3 server runs; otherwise on the test control
# plane with the operator as a subprocess. Tests written for both use the e2e_* fixtures.


@pytest.fixture(scope="session")
def kind_cluster() -> Iterator[Any]:
    """The kind cluster, with every SpotRL pod's log kept for the whole session (a pod a test
    deletes, or the operator replaces, takes its log off the nodes)."""
    from kind.kind_cluster import KindCluster

    cluster = KindCluster.from_env()
    keeper = cluster.keep_pod_logs()
    try:
        yield cluster
    finally:
        keeper.stop()


@pytest.fixture
def e2e_cluster(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The cluster of the end-to-end tests (test control plane, or kind)."""
    if TARGET == "kind":
        cluster = request.getfixturevalue("kind_cluster")
        yield cluster
        cluster.reset_nodes()
    else:
        yield request.getfixturevalue("cluster")


@pytest.fixture
def e2e_namespace(e2e_cluster: Any, request: pytest.FixtureRequest) -> Iterator[str]:
    prefix = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower().removeprefix("test_")).strip("-")
    name = e2e_cluster.create_namespace(prefix[:30] or "e2e", pod_security="restricted")
    yield name
    e2e_cluster.delete_namespace(name)


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace named after the test that enforces Pod Security ``restricted``, as
    a platform team's would: every pod the operator makes must pass it."""
    prefix = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower().removeprefix("test_")).strip("-")
    name = cluster.create_namespace(prefix or "test", pod_security="restricted")
    yield name
    cluster.delete_namespace(name)


@pytest.fixture
def e2e_storage(request: pytest.FixtureRequest) -> Iterator[JobStorage]:
    """A fresh bucket: on the test S3 server (local), or on the kind cluster's S3 server."""
    if TARGET == "kind":
        yield kind_bucket()
    else:
        b = request.getfixturevalue("s3_bucket")
        yield JobStorage(b.bucket, b.endpoint, b.endpoint, b.access_key, b.secret_key, b.region)


@pytest.fixture(scope="session")
def e2e_session_storage(request: pytest.FixtureRequest) -> Iterator[JobStorage]:
    """A bucket for the whole run (the reference run's cuts and audit)."""
    if TARGET == "kind":
        yield kind_bucket()
        return
    server = request.getfixturevalue("s3_server")
    b = server.create_bucket("reference")
    yield JobStorage(b.bucket, b.endpoint, b.endpoint, b.access_key, b.secret_key, b.region)
    server.delete_bucket(b)


@pytest.fixture(scope="session")
def reference(e2e_session_storage: JobStorage, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    """The effective stream of the tiny job never preempted (``test_preemption.run_reference``),
    once per run: every preempted, evicted or reclaimed tiny job is compared with it."""
    from test_preemption import run_reference

    return run_reference(e2e_session_storage, tmp_path_factory.mktemp("reference"))


@pytest.fixture
def e2e_operator(e2e_cluster: Any, request: pytest.FixtureRequest) -> OperatorProcess | None:
    """The operator: on kind the chart's (installed by run.sh; checked to be available), on
    the test control plane a subprocess with the chart's identity."""
    if TARGET == "kind":
        ns = os.environ.get("SPOTRL_E2E_OPERATOR_NAMESPACE", "spotrl-system")
        release = os.environ.get("SPOTRL_E2E_OPERATOR_RELEASE", "spotrl")
        e2e_cluster.kubectl("rollout", "status", f"deployment/{release}", "-n", ns, "--timeout=120s")
        return None
    start: Callable[..., OperatorProcess] = request.getfixturevalue("start_operator")
    return start()


@pytest.fixture
def e2e_jobs(e2e_cluster: Any, e2e_namespace: str, e2e_operator: OperatorProcess | None) -> Iterator[Jobs]:
    j = Jobs(e2e_cluster, e2e_namespace)
    yield j
    j.cleanup()
