"""e2e/toolchain/system-packages.sh: what a make target does when a command it needs is missing."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "e2e" / "toolchain" / "system-packages.sh"


def run(tmp_path: Path, *pairs: str, apt: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SPOTRL_APT_LOCK": str(tmp_path / "apt.lock")}
    if apt is not None:
        env["SPOTRL_APT_GET"] = apt
    return subprocess.run(["bash", str(SCRIPT), "make e2e-kind", *pairs], capture_output=True, text=True, env=env)


def fake_apt(tmp_path: Path) -> tuple[str, Path]:
    calls = tmp_path / "calls"
    apt = tmp_path / "apt-get"
    apt.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    apt.chmod(0o755)
    return str(apt), calls


def test_nothing_missing_installs_nothing(tmp_path: Path) -> None:
    apt, calls = fake_apt(tmp_path)
    r = run(tmp_path, "bash:bash", "sh:dash", apt=apt)
    assert (r.returncode, r.stderr) == (0, "")
    assert not calls.exists()


def test_missing_commands_install_their_packages_once(tmp_path: Path) -> None:
    apt, calls = fake_apt(tmp_path)
    r = run(tmp_path, "bash:bash", "no-such-tool-1:pkg-a", "no-such-tool-2:pkg-a", "no-such-tool-3:pkg-b", apt=apt)
    if os.geteuid() != 0:
        assert r.returncode == 2
        return
    assert r.returncode == 0, r.stderr
    assert "make e2e-kind: installing pkg-a pkg-b (apt-get)" in r.stderr
    update, install = calls.read_text().splitlines()
    assert update == "update -q"
    assert install.split()[-3:] == ["ca-certificates", "pkg-a", "pkg-b"]


def test_without_apt_get_one_line_says_what_to_run(tmp_path: Path) -> None:
    r = run(tmp_path, "no-such-tool:debootstrap", apt=str(tmp_path / "no-apt-get"))
    assert r.returncode == 2
    assert r.stderr.strip() == (
        "make e2e-kind: missing debootstrap: install them first (Debian/Ubuntu: sudo apt-get install -y debootstrap)"
    )


def test_a_shared_library_is_looked_up_with_the_dynamic_linker(tmp_path: Path) -> None:
    """``libc.so.6:libc6`` is there (ldconfig knows it); a library nobody has is installed."""
    apt, calls = fake_apt(tmp_path)
    r = run(tmp_path, "libc.so.6:libc6", "libspotrl-none.so.1:libspotrl-none1", apt=apt)
    if os.geteuid() != 0:
        assert r.returncode == 2
        assert "missing libspotrl-none1:" in r.stderr
        return
    assert r.returncode == 0, r.stderr
    assert calls.read_text().splitlines()[-1].split()[-2:] == ["ca-certificates", "libspotrl-none1"]
