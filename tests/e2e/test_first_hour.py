"""A user's first hour: the commands of the README's "Run it on Kubernetes" section, run as
written (the block between ``<!-- first-hour:begin -->`` and ``<!-- first-hour:end -->``), on
the kind cluster of ``make e2e-kind`` before the suite installs its own chart.

The README's shell variables are the only inputs: the bucket, the S3 endpoint and keys of the
cluster's S3 server, and ``SPOTRL_IMAGES`` naming the images built here. ``kubectl get rljobs
-w`` is watched until it shows what the README says it shows; then the next command runs.
The job must train all 40 steps of examples/tiny-cpu.yaml, once each, through the drain.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from operator_harness import TARGET, Jobs, JobStorage, kind_bucket

from spotrl_e2e.docs import command_lines, marked_block

pytestmark = [
    pytest.mark.slow,
    pytest.mark.kind_ci,  # CI's kind subset runs the first hour before the chart goes in for the rest
    pytest.mark.skipif(
        TARGET != "kind",
        reason="the README's commands need a real cluster (kubelets, the images, helm install); make e2e-kind runs it",
    ),
]
REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
JOB = "tiny-arith"  # examples/tiny-cpu.yaml
TOTAL = 40


def readme_commands() -> list[str]:
    """The commands of the README's first-hour block (``<!-- first-hour:begin -->``),
    continuation lines joined, comments dropped."""
    block = marked_block(README.read_text(), README, "<!-- first-hour:begin -->")
    return list(command_lines(block))


class Watch:
    """``kubectl get rljobs -w`` in the background; its lines as the user sees them."""

    def __init__(self, command: str, env: dict[str, str], log: Path):
        self.log = log
        self.proc = subprocess.Popen(["bash", "-c", command], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)

    def rows(self) -> list[tuple[str, int | None]]:
        """(PHASE, STEP) of each line about the job. Not split on whitespace: an empty column
        (STEP before the first step) would shift the others; STEP is the number just before
        TOTAL, which is known."""
        row = re.compile(rf"^{JOB}\s+(?P<phase>[A-Z][a-z]+)\s+(?:(?P<step>\d+)\s+)?{TOTAL}\s")
        out = []
        for line in self.log.read_text().splitlines():
            m = row.match(line)
            if m:
                out.append((m["phase"], int(m["step"]) if m["step"] else None))
        return out

    def until(self, check: Any, timeout: float, what: str) -> tuple[str, int | None]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for row in self.rows():
                if check(row):
                    return row
            time.sleep(1)
        raise AssertionError(f"`kubectl get rljobs -w` never showed {what} in {timeout:.0f} s:\n{self.log.read_text()}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def test_the_readme_kubernetes_section_runs_as_written(e2e_cluster: Any, tmp_path: Path) -> None:
    storage: JobStorage = kind_bucket()
    env = {
        **os.environ,
        "BUCKET": storage.bucket,
        "S3_ENDPOINT": storage.pod_endpoint,
        "AWS_ACCESS_KEY_ID": storage.access_key,
        "AWS_SECRET_ACCESS_KEY": storage.secret_key,
        "SPOTRL_IMAGES": os.environ["SPOTRL_E2E_CHART_IMAGES"],
        "HOME": str(tmp_path),
    }
    commands = readme_commands()
    watches = [c for c in commands if c == "kubectl get rljobs -w"]
    assert len(watches) == 2, f"the block should watch twice (training, then finished): {commands}"
    jobs = Jobs(e2e_cluster, "default")
    drained: list[str] = []
    watch_no = 0
    try:
        for command in commands:
            if command == "kubectl get rljobs -w":
                watch = Watch(command, env, tmp_path / f"watch-{watch_no}.log")
                try:
                    if watch_no == 0:
                        watch.until(
                            lambda r: r[0] == "Running" and (r[1] or 0) >= 5,
                            600,
                            "Running past step 5",
                        )
                    else:
                        watch.until(lambda r: r == ("Succeeded", TOTAL), 900, "Succeeded at the last step")
                finally:
                    watch.stop()
                print(f"$ {command}\n{watch.log.read_text()}")
                watch_no += 1
                continue
            if command.startswith("kubectl drain"):
                drained.append(jobs.status(JOB)["controllerNode"])
            out = subprocess.run(
                ["bash", "-c", command], env=env, cwd=REPO, capture_output=True, text=True, timeout=600
            )
            print(f"$ {command}\n{out.stdout}{out.stderr}")
            assert out.returncode == 0, f"`{command}` exited {out.returncode}:\n{out.stdout}{out.stderr}"

        st = jobs.status(JOB)
        assert st["phase"] == "Succeeded", json.dumps(st, indent=1)
        assert st["step"] == TOTAL, json.dumps(st, indent=1)
        assert drained, "the block never drained a node"
        assert st["preemptions"] == 1, json.dumps(st, indent=1)
        assert st["controllerNode"] not in drained
        jobs.said(JOB, {"PreemptionNotice", "BarrierCommitted", "Resumed"})
        steps = audit_steps(storage, env)
        assert steps == list(range(TOTAL)), f"steps in the effective stream: {steps}"
    finally:
        for node in drained:
            e2e_cluster.kubectl("uncordon", node, check=False)
        e2e_cluster.kubectl(
            "delete", "rljob", JOB, "-n", "default", "--ignore-not-found", "--timeout=120s", check=False
        )
        subprocess.run(
            ["helm", "uninstall", "spotrl", "-n", "spotrl-system", "--wait"], env=env, check=False, timeout=300
        )
        e2e_cluster.kubectl("delete", "secret", "spotrl-s3", "-n", "default", "--ignore-not-found", check=False)


def audit_steps(storage: JobStorage, env: dict[str, str]) -> list[int]:
    """`spotrl audit` of the job's cuts (the chart's default storage: <default>/<ns>/<name>)."""
    uri = f"s3://{storage.bucket}/spotrl/default/{JOB}"
    argv = [sys.executable, "-m", "spotrl_runtime.cli", "audit", uri, "--endpoint", storage.host_endpoint]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, f"{shlex.join(argv)}:\n{out.stdout}{out.stderr}"
    return sorted(int(json.loads(line)["step"]) for line in out.stdout.splitlines() if line.strip())
