"""The security scan's cache (e2e/scan/scan.py): a scanner's output is reused only for the same
scanner, arguments and manifest bytes; anything else runs the scanner again."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

SCAN = Path(__file__).resolve().parents[2] / "e2e" / "scan" / "scan.py"


@pytest.fixture
def scan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("spotrl_scan_under_test", SCAN)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "CACHE", tmp_path / "cache")
    return module


def scanner(tmp_path: Path, name: str = "scanner") -> tuple[Path, Path]:
    """A scanner that counts its runs and prints its manifest's first line as JSON."""
    runs = tmp_path / f"{name}-runs"
    tool = tmp_path / name
    tool.write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"open({str(runs)!r}, 'a').write('x')\n"
        "print(json.dumps({'first': open(sys.argv[-1]).readline().strip(), 'args': sys.argv[1:-1]}))\n"
    )
    tool.chmod(0o755)
    return tool, runs


def test_the_same_inputs_are_scanned_once_and_any_change_scans_again(scan, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    tool, runs = scanner(tmp_path)
    manifest = tmp_path / "a" / "objects.yaml"
    manifest.parent.mkdir()
    manifest.write_text("kind: Pod\n")

    def run(*flags: str) -> dict:
        return scan._json_of([str(tool), *flags, str(manifest)], "the scanner", manifest)

    assert run("-o", "json") == {"first": "kind: Pod", "args": ["-o", "json"]}
    assert run("-o", "json") == {"first": "kind: Pod", "args": ["-o", "json"]}
    assert runs.read_text() == "x", "the second scan came from the cache"

    elsewhere = tmp_path / "b" / "objects.yaml"  # the same bytes in another folder: the same scan
    elsewhere.parent.mkdir()
    elsewhere.write_text("kind: Pod\n")
    assert scan._json_of([str(tool), "-o", "json", str(elsewhere)], "the scanner", elsewhere)["first"] == "kind: Pod"
    assert runs.read_text() == "x"

    manifest.write_text("kind: Deployment\n")
    assert run("-o", "json")["first"] == "kind: Deployment", "new bytes are scanned"
    assert run("-o", "yaml")["args"] == ["-o", "yaml"], "new arguments are scanned"
    os.utime(tool, ns=(1, 1))
    run("-o", "yaml")
    assert runs.read_text() == "xxxx", "another scanner binary scans again"


def test_a_scanner_that_writes_no_json_is_an_error_and_nothing_is_cached(scan, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    tool = tmp_path / "broken"
    tool.write_text("#!/bin/sh\necho 'Traceback: no' >&2\necho not-json\n")
    tool.chmod(0o755)
    manifest = tmp_path / "objects.yaml"
    manifest.write_text("kind: Pod\n")
    with pytest.raises(scan.ScanError, match="wrote no JSON: Traceback: no"):
        scan._json_of([str(tool), str(manifest)], "broken", manifest)
    assert not list((tmp_path / "cache").glob("*.json")), "a failed scan is run again next time"
