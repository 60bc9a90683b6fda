"""The node agent's pure pod-to-process mapping (no cluster needed)."""

from pathlib import Path
from typing import Any

import pytest

from spotrl_e2e.nodeagent.podspec import PodConfigError, command_line, container_env, expand, rewrite_path

MOUNTS = {"/data": Path("/tmp/pod/volumes/data"), "/data/cache": Path("/tmp/pod/volumes/cache")}


def test_expand_follows_kubernetes_rules() -> None:
    env = {"A": "1", "B": "two"}
    assert expand("$(A)-$(B)", env) == "1-two"
    assert expand("$(MISSING)", env) == "$(MISSING)"
    assert expand("$$(A)", env) == "$(A)"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("/data", "/tmp/pod/volumes/data"),
        ("/data/x/y", "/tmp/pod/volumes/data/x/y"),
        ("/data/cache/z", "/tmp/pod/volumes/cache/z"),
        ("--dir=/data/x", "--dir=/tmp/pod/volumes/data/x"),
        ("/database", "/database"),
        ("relative/data", "relative/data"),
    ],
)
def test_rewrite_path_maps_mount_paths_only(value: str, expected: str) -> None:
    assert rewrite_path(value, MOUNTS) == expected


def test_env_order_refs_and_missing_secret() -> None:
    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": "u"}, "spec": {"nodeName": "n"}, "status": {}}
    data = {("ConfigMap", "ns", "cm"): {"k": "v"}}

    def lookup(kind: str, ns: str, name: str) -> dict[str, str] | None:
        return data.get((kind, ns, name))

    container: dict[str, Any] = {
        "name": "c",
        "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "X_"}],
        "env": [
            {"name": "N", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "M", "value": "$(N)/$(X_k)"},
            {"name": "OPT", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "k", "optional": True}}},
        ],
    }
    env = container_env(pod, container, lookup, {"PATH": "/bin"})
    assert env == {"PATH": "/bin", "X_k": "v", "N": "n", "M": "n/v"}
    container["env"] = [{"name": "REQ", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "k"}}}]
    with pytest.raises(PodConfigError, match=r"env\[REQ\]: Secret 'absent' not found"):
        container_env(pod, container, lookup, {})


def test_command_is_required_and_image_paths_fall_back_to_path() -> None:
    with pytest.raises(PodConfigError, match="command is empty"):
        command_line({"name": "c", "args": ["x"]}, {}, {}, lambda p: None)
    argv = command_line(
        {"name": "c", "command": ["/usr/local/bin/spotrl"], "args": ["--out=/data"]},
        {},
        MOUNTS,
        lambda p: f"/venv/bin/{p}",
    )
    assert argv == ["/venv/bin/spotrl", "--out=/tmp/pod/volumes/data"]


def test_an_image_tagged_with_a_release_folder_runs_that_release_and_any_other_this_checkout(tmp_path: Path) -> None:
    from spotrl_e2e.nodeagent.config import AgentConfig
    from spotrl_e2e.nodeagent.pods import release_source

    (tmp_path / "02aa473610d5" / "runtime").mkdir(parents=True)
    (tmp_path / "no-runtime").mkdir()
    cfg = AgentConfig("https://x", "ca", "pki", "work", "bin", 0, [], image_sources=str(tmp_path))
    assert release_source(cfg, "spotrl-runtime-cpu:02aa473610d5") == tmp_path / "02aa473610d5" / "runtime"
    assert release_source(cfg, "registry:5000/spotrl-runtime-cpu:02aa473610d5") == tmp_path / "02aa473610d5" / "runtime"
    for image in ("spotrl-runtime-cpu:0.1.0", "spotrl-runtime-cpu:no-runtime", "registry:5000/spotrl", "", "x:.."):
        assert release_source(cfg, image) is None, image
    assert release_source(AgentConfig("https://x", "ca", "pki", "work", "bin", 0, []), "spotrl:02aa473610d5") is None
