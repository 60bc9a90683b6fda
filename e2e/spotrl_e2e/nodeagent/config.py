"""What the node agent is told: the API server, where its certificates are, and its Nodes."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CAPACITY_TYPE_LABEL = "karpenter.sh/capacity-type"
GPU_RESOURCE = "nvidia.com/gpu"


@dataclass
class Taint:
    key: str
    value: str | None = None
    effect: str = "NoSchedule"

    def to_api(self) -> dict[str, str]:
        out = {"key": self.key, "effect": self.effect}
        if self.value is not None:
            out["value"] = self.value
        return out


@dataclass
class NodeSpec:
    """One Node the agent plays kubelet for.

    ``capacity_type`` sets the ``karpenter.sh/capacity-type`` label (``spot`` or
    ``on-demand``); ``gpus`` advertises that many ``nvidia.com/gpu`` for the scheduler (no
    GPU is really there)."""

    name: str
    capacity_type: str | None = "spot"
    labels: dict[str, str] = field(default_factory=dict)
    taints: list[Taint] = field(default_factory=list)
    cpu: str = "4"
    memory: str = "16Gi"
    pods: int = 110
    gpus: int = 0

    def all_labels(self) -> dict[str, str]:
        labels = {
            "kubernetes.io/hostname": self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "node.kubernetes.io/instance-type": "spotrl-fake",
        }
        if self.capacity_type:
            labels[CAPACITY_TYPE_LABEL] = self.capacity_type
        return {**labels, **self.labels}

    def capacity(self) -> dict[str, str]:
        cap = {"cpu": self.cpu, "memory": self.memory, "pods": str(self.pods), "ephemeral-storage": "100Gi"}
        if self.gpus:
            cap[GPU_RESOURCE] = str(self.gpus)
        return cap

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NodeSpec:
        d = dict(d)
        d["taints"] = [Taint(**t) for t in d.get("taints", [])]
        return cls(**d)


@dataclass
class AgentConfig:
    """Everything the agent process needs; written as JSON by the harness."""

    server: str
    ca: str
    pki_dir: str
    workdir: str
    python_bin: str
    control_port: int
    nodes: list[NodeSpec]
    kubelet_version: str = "v1.35.4"
    lease_seconds: int = 40
    lease_renew_seconds: float = 2.0
    status_seconds: float = 10.0
    # Crash-loop back-off: kubelet starts at 10 s and caps at 300 s; tests cannot wait that long.
    backoff_initial: float = 1.0
    backoff_max: float = 20.0
    image_env: dict[str, str] = field(default_factory=dict)
    """What the runtime image's ENV lines set (the Dockerfile's): every container gets it."""
    image_sources: str = ""
    """A folder of other releases' code, one folder per image tag: a container whose image's tag
    names one runs that release's ``runtime/`` (first on its ``PYTHONPATH``), as a pod of that
    release's image would; any other image runs this checkout's."""

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> AgentConfig:
        d = json.loads(path.read_text())
        d["nodes"] = [NodeSpec.from_dict(n) for n in d["nodes"]]
        return cls(**d)
