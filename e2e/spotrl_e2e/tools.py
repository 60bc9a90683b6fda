"""Where the control plane's binaries are: the cache that ``e2e/toolchain/build.sh`` fills."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

E2E_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = E2E_DIR.parent
BUILD_SCRIPT = E2E_DIR / "toolchain" / "build.sh"


class ToolchainMissingError(RuntimeError):
    """A binary of the test control plane has not been built."""


@dataclass(frozen=True)
class Tools:
    """Paths of the binaries, one attribute per tool."""

    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    etcd: Path
    helm: Path
    versitygw: Path
    kube_score: Path | None = None
    checkov: Path | None = None
    """The security scanners (tests/security); the control plane does not need them."""
    kueue: Path | None = None
    kueue_manifests: Path | None = None
    """Kueue's manager and its CRDs and webhook configurations (the RLJob queueing tests)."""
    karpenter_crds: Path | None = None
    """Karpenter's CRDs (NodePool, NodeClaim, EC2NodeClass): the docs' manifests are dry-run against them."""

    def require(self, *names: str) -> None:
        """Raises :class:`ToolchainMissingError` naming every absent binary and how to build it."""
        missing = [
            f"{n} ({getattr(self, n)})"
            for n in names
            if getattr(self, n) is None or not os.access(getattr(self, n), os.X_OK)
        ]
        if missing:
            raise ToolchainMissingError(
                "test control plane binaries not built: " + ", ".join(missing) + f"; run `make toolchain` "
                f"(or {BUILD_SCRIPT}) first, or point SPOTRL_TOOLS_DIR at a cache that has them"
            )


def find_tools() -> Tools:
    """Asks ``build.sh --env`` where each binary lives (it builds nothing)."""
    out = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--env"], check=True, capture_output=True, text=True, timeout=30
    ).stdout
    env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return Tools(**{k.lower(): Path(v) for k, v in env.items()})
