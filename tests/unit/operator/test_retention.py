"""What retentionPolicy Delete counts as the job's: the prefixes the runtime writes."""

from __future__ import annotations

import subprocess
import sys

from spotrl_operator.retention import JOB_KEYS, JOB_PREFIXES
from spotrl_runtime.checkpoint.fence import ATTEMPTS


def test_the_job_prefixes_cover_the_fence_claims_cuts_audit_and_pointer() -> None:
    assert f"{ATTEMPTS}/" in JOB_PREFIXES
    assert {"cuts/", "audit/"} <= set(JOB_PREFIXES)
    assert JOB_KEYS == ("LATEST.json",)


def test_the_retention_module_imports_without_torch() -> None:
    """The operator image has no torch: retention must not reach the checkpoint package."""
    code = "import sys, spotrl_operator.retention; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
