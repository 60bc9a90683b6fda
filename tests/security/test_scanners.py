"""checkov and kube-score on the rendered chart and on the objects the operator creates for
each example (e2e/scan): nothing beyond e2e/scan/allowlist.yaml, and the allow-list has no
stale entry. The scan fails on a privileged pod, naming the checks, so a pass means something.

The scanners come from the tool cache (`make toolchain`). Without them these tests skip,
except in CI (CI=true), where a missing scanner is a failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCAN = REPO / "e2e" / "scan" / "scan.py"
RENDER = REPO / "e2e" / "scan" / "render.py"

pytestmark = pytest.mark.slow

BAD_POD = """\
apiVersion: v1
kind: Pod
metadata:
  name: bad
  namespace: team-a
spec:
  containers:
  - name: c
    image: ghcr.io/spotrl/spotrl-runtime:0.1.0
    securityContext:
      privileged: true
"""


def _scan(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCAN), *map(str, args)], capture_output=True, text=True, timeout=600, cwd=REPO
    )


@pytest.fixture(scope="module")
def scanners() -> None:
    listed = subprocess.run(
        [str(REPO / "e2e/toolchain/build.sh"), "--env"], check=True, capture_output=True, text=True
    ).stdout
    paths = dict(line.split("=", 1) for line in listed.splitlines())
    missing = [f"{n} ({paths.get(n)})" for n in ("CHECKOV", "KUBE_SCORE", "HELM") if not _executable(paths.get(n))]
    if missing:
        message = f"scanners not built: {', '.join(missing)}; run `make toolchain`"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


def _executable(path: str | None) -> bool:
    return bool(path) and os.access(str(path), os.X_OK)


@pytest.fixture(scope="module")
def rendered(scanners: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("rendered")
    subprocess.run([sys.executable, str(RENDER), str(out)], check=True, cwd=REPO)
    return out


def test_render_has_every_set_and_pod(rendered: Path) -> None:
    sets = sorted(p.name for p in rendered.iterdir())
    assert sets == [
        "chart",
        "chart-watch-namespaces",
        "operator-cpu-agent-calculator",
        "operator-cpu-chat-gsm8k",
        "operator-cpu-chat-gsm8k-lora",
        "operator-gpu-qwen-7b-lora",
        "operator-gpu-qwen-fsdp",
        "operator-gpu-qwen-gsm8k",
        "operator-tiny-cpu",
        "operator-tiny-cpu-worker-pods",
    ]
    tiny = (rendered / "operator-tiny-cpu" / "objects.yaml").read_text()
    workers = (rendered / "operator-tiny-cpu-worker-pods" / "objects.yaml").read_text()
    fsdp = (rendered / "operator-gpu-qwen-fsdp" / "objects.yaml").read_text()
    assert "name: tiny-arith-controller-1" in tiny
    assert "name: tiny-arith-worker-1-0" not in tiny
    assert "-trainer-1-0" not in tiny + workers
    assert "name: tiny-arith-worker-1-0" in workers
    assert "name: qwen7b-gsm8k-fsdp-trainer-1-0" in fsdp
    assert "kind: Deployment" in (rendered / "chart" / "objects.yaml").read_text()


def test_the_scan_passes(rendered: Path) -> None:
    proc = _scan("--rendered", rendered)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_privileged_pod_fails_the_scan_by_name(scanners: None, tmp_path: Path) -> None:
    """A pod with a privileged container and nothing else set: both scanners name it; an
    allow-list entry takes exactly its finding out, and an entry that matches nothing fails."""
    (tmp_path / "rendered" / "operator-bad").mkdir(parents=True)
    (tmp_path / "rendered" / "operator-bad" / "objects.yaml").write_text(BAD_POD)
    allowlist = tmp_path / "allowlist.yaml"
    allowlist.write_text(
        textwrap.dedent("""\
        allowed:
          - scanner: checkov
            check: CKV_K8S_43
            object: Pod/bad
            reason: the test allows this one finding
          - scanner: kube-score
            check: container-image-tag
            object: Pod/*-controller-*
            reason: matches nothing here, so it is stale
        """)
    )
    proc = _scan("--rendered", tmp_path / "rendered", "--allowlist", allowlist)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    not_allowed = proc.stdout.split("NOT ALLOWED", 1)[1].split("STALE", 1)[0]
    assert "checkov CKV_K8S_16 operator-bad Pod/bad: Container should not be privileged" in not_allowed
    assert "kube-score container-security-context-privileged (critical) operator-bad Pod/bad container c" in not_allowed
    assert "CKV_K8S_43" not in not_allowed
    stale = proc.stdout.split("STALE", 1)[1]
    assert "kube-score container-image-tag * Pod/*-controller-*" in stale


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ("{scanner: checkov, check: CKV_K8S_43, object: Pod/x}", "'reason' is required"),
        ("{scanner: checkov, check: CKV_K8S_43, object: Pod/x, reason: ' '}", "'reason' is required"),
        ("{scanner: checkov, check: 'CKV_K8S_*', object: Pod/x, reason: r}", "must name one check"),
        ("{scanner: trivy, check: X, object: Pod/x, reason: r}", "scanner must be one of"),
        ("{scanner: checkov, check: X, object: Pod/x, container: c, reason: r}", "drop 'container'"),
    ],
)
def test_the_allowlist_refuses_entries_without_a_reason_or_with_wildcard_checks(
    tmp_path: Path, entry: str, problem: str
) -> None:
    allowlist = tmp_path / "allowlist.yaml"
    allowlist.write_text(f"allowed:\n  - {entry}\n")
    proc = _scan("--rendered", tmp_path, "--allowlist", allowlist)
    assert proc.returncode == 2
    assert "allowlist.yaml line 2" in proc.stderr
    assert problem in proc.stderr


def test_the_allowlist_in_the_repo_is_valid() -> None:
    """Every entry has a reason and one check id (checked before the scanners are looked for)."""
    proc = _scan("--rendered", REPO / "does-not-exist", "--allowlist", REPO / "e2e/scan/allowlist.yaml")
    assert "allowlist.yaml line" not in proc.stderr, proc.stderr
