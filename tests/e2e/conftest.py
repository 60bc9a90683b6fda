"""Fixtures of the operator tests: the CRD, the chart's operator identity, a running operator,
and the RLJobs of one test (deleted through the operator's finalizer afterwards)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from operator_harness import Jobs, OperatorProcess, apply_crd, install_operator_identity

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
    stopped at the end of the test."""
    namespace, kubeconfig = operator_identity
    started: list[OperatorProcess] = []

    def start(args: tuple[str, ...] = (), wait: str | None = "lead", name: str = "operator") -> OperatorProcess:
        op = OperatorProcess(cluster, kubeconfig, namespace, tmp_path, name=name, args=args)
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
