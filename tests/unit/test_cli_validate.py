"""`spotrl validate`: exit codes and messages a user sees."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _spotrl(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spotrl_runtime.cli", *args], input=stdin, capture_output=True, text=True, cwd=ROOT
    )


def test_examples_validate() -> None:
    out = _spotrl("validate", "-f", "examples/tiny-cpu.yaml", "-f", "examples/gpu-qwen-gsm8k.yaml")
    assert out.returncode == 0, out.stderr
    assert "RLJob tiny-arith is valid" in out.stdout


def test_bad_document_fails_and_names_fields() -> None:
    bad = (ROOT / "examples/tiny-cpu.yaml").read_text().replace("groupSize: 8", "groupSize: 1")
    out = _spotrl("validate", "-f", "-", stdin=bad)
    assert out.returncode == 1
    assert "spec.generation.groupSize: Input should be greater than or equal to 2" in out.stderr


def test_a_yaml_syntax_error_is_one_line_with_where_and_exit_2() -> None:
    out = _spotrl("validate", "-f", "-", stdin="spec:\n  policy: {model: [unclosed\n")
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("spotrl validate: -f -: line ")
    assert "not valid YAML" in line


def test_a_missing_file_is_one_line_and_exit_2(tmp_path: pathlib.Path) -> None:
    out = _spotrl("validate", "-f", str(tmp_path / "nope.yaml"))
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert "nope.yaml: cannot read it (No such file or directory)" in out.stderr
