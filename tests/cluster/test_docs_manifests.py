"""Every manifest in the docs, against the real API server: a server-side dry run of each
Kubernetes object (RLJobs, Kueue's and Karpenter's objects against their real CRDs), and each
block of Helm values rendered by the pinned helm and dry-run in turn. A user who copies an
example gets an object the cluster accepts."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from spotrl_e2e.cluster import Cluster
from spotrl_e2e.docs import FRAGMENT, HELM_VALUES, Block, blocks, doc_files
from spotrl_e2e.tools import REPO_ROOT

pytestmark = pytest.mark.cluster
CHART = REPO_ROOT / "charts" / "spotrl"
RLJOB_CRD = REPO_ROOT / "crds" / "rljobs.spotrl.dev.yaml"


def _yaml_blocks() -> list[Block]:
    return [b for p in doc_files() for b in blocks((REPO_ROOT / p).read_text(), p) if b.lang in ("yaml", "yml")]


@pytest.fixture(scope="module")
def crds(spotrl_cluster_session: Cluster) -> Cluster:
    """The RLJob's, Kueue's and Karpenter's CRDs, served."""
    cluster = spotrl_cluster_session
    tools = cluster.tools
    assert tools.kueue_manifests is not None, "run `make toolchain`"
    assert tools.karpenter_crds is not None, "run `make toolchain`"
    files = [RLJOB_CRD, *sorted((tools.kueue_manifests / "crds").glob("*.yaml"))]
    files += sorted(tools.karpenter_crds.glob("*.yaml"))
    cluster.install_crds(files)
    return cluster


def _dry_run(cluster: Cluster, text: str) -> subprocess.CompletedProcess[str]:
    """A server-side dry run of every object in ``text``; one without a namespace is dry-run
    in ``default``, as ``kubectl apply`` would put it there."""
    _ensure_namespaces(cluster, [d for d in yaml.safe_load_all(text) if d])
    return cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=text, check=False, timeout=60)


def _ensure_namespaces(cluster: Cluster, docs: list[dict]) -> None:
    """The namespaces the objects name, made for real: a dry run cannot create into one it only
    pretended to make."""
    for ns in {(d.get("metadata") or {}).get("namespace") for d in docs} - {None}:
        if cluster.admin().get_or_none(f"/api/v1/namespaces/{ns}") is None:
            cluster.admin().create(
                "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
            )


def test_every_kubernetes_object_in_the_docs_passes_a_server_side_dry_run(crds: Cluster) -> None:
    checked, problems = 0, []
    for block in _yaml_blocks():
        if block.marker in (FRAGMENT, HELM_VALUES):
            continue
        docs = [d for d in yaml.safe_load_all(block.text) if d]
        result = _dry_run(crds, block.text)
        if result.returncode != 0:
            problems.append(f"{block.where()}: {result.stderr.strip()}")
        checked += len(docs)
    assert checked >= 15, "the docs lost their examples, or this test lost track of them"
    assert not problems, "\n".join(problems)


def test_every_helm_values_block_in_the_docs_renders_and_its_objects_pass_a_dry_run(
    crds: Cluster, namespace: str, tmp_path: Path
) -> None:
    values_blocks = [b for b in _yaml_blocks() if b.marker == HELM_VALUES]
    assert values_blocks, "the docs show no Helm values"
    problems = []
    for i, block in enumerate(values_blocks):
        values = tmp_path / f"values-{i}.yaml"
        values.write_text(block.text)
        rendered = subprocess.run(
            [str(crds.tools.helm), "template", "spotrl", str(CHART), "-n", namespace, "--kube-version", "1.35.4",
             "-f", str(values)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        if rendered.returncode != 0:
            problems.append(f"{block.where()}: helm template: {rendered.stderr.strip()}")
            continue
        result = _dry_run(crds, rendered.stdout)
        if result.returncode != 0:
            problems.append(f"{block.where()}: dry run of what it renders: {result.stderr.strip()}")
    assert not problems, "\n".join(problems)
