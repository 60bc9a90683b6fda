"""``make mutations``: each patch in ``tests/mutations/`` is a plausible broken implementation,
and the tests it names must fail with it applied. A test that still passes proves nothing.

A patch is a unified diff against the repository root (``git diff``'s output) after header lines::

    # test: tests/integration/controller/test_controller_lora.py::test_a_lora_cut_holds_the_adapter_alone
    # claim: a LoRA cut holds the adapter alone; this writer saves the frozen base too

Each patch is applied to its own scratch copy of the work tree (tracked and untracked files,
not the ignored ones), never to the tree itself, and its tests run there with a Python whose
``sys.path`` starts at that copy: a subprocess a test starts by ``sys.executable``, by the
``spotrl`` script beside it or by ``$PATH`` imports the mutated code too, whatever its
``PYTHONPATH``. The installed packages are the work tree's ``.venv``'s.

    python -m spotrl_e2e.mutations [PATCH ...] [--keep]

Prints a table (patch, tests, verdict, seconds) and exits 1 when a mutation survived, a patch
no longer applies, or its tests did not fail in their own bodies (a fixture that errored proves
nothing). Each patch's pytest output: ``.out/mutations/<patch>.log``. It is a developer's tool, not part of CI's
time: each patch runs its (often slow) tests once."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MUTATIONS = ROOT / "tests" / "mutations"
SOURCE_DIRS = ("runtime", "operator", "e2e")
LOGS = ROOT / ".out" / "mutations"
"""Each patch's pytest output and JUnit report: ``<patch>.log``, ``<patch>.xml``."""


class PatchError(ValueError):
    """A patch file whose header does not say which tests must fail."""


@dataclass(frozen=True)
class Mutation:
    path: Path
    tests: tuple[str, ...]
    claim: str


def parse(path: Path, text: str) -> Mutation:
    """The header of a patch: its ``# test:`` node ids (at least one) and its ``# claim:``."""
    tests: list[str] = []
    claim = ""
    for line in text.splitlines():
        if line.startswith("diff --git") or line.startswith("--- "):
            break
        key, _, value = line.removeprefix("#").partition(":")
        if not line.startswith("#") or not value.strip():
            continue
        if key.strip() == "test":
            tests.append(value.strip())
        elif key.strip() == "claim":
            claim = value.strip()
    if not tests:
        raise PatchError(f"{path.name}: no '# test: tests/...::name' line before the diff: name the tests it must fail")
    if not claim:
        raise PatchError(f"{path.name}: no '# claim: ...' line before the diff: say what it breaks")
    outside = [t for t in tests if not t.startswith("tests/")]
    if outside:
        raise PatchError(f"{path.name}: '# test:' {outside[0]} is not a node id under tests/")
    return Mutation(path, tuple(tests), claim)


def verdict(code: int, junit: str | None) -> str:
    """How a patch's run ended: killed only when a named test failed in its own body. A run that
    passed let the mutation survive; one whose tests errored in a fixture (a fixture that
    could not start, a missing tool), were not collected or did not run proves nothing."""
    if code == 0:
        return "SURVIVED"
    cases = list(ET.fromstring(junit).iter("testcase")) if junit else []
    failed = sum(case.find("failure") is not None for case in cases)
    if failed:
        return "killed" if failed == len(cases) else f"killed by {failed} of {len(cases)}"
    if any(case.find("error") is not None for case in cases):
        return "no verdict (a fixture errored: read its log)"
    return f"no verdict (pytest exit {code})"


def copy_tree(into: Path) -> None:
    """The work tree's tracked and untracked (not ignored) files, as they are now."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)


def share_history(tree: Path) -> None:
    """A git repository in ``tree`` that reads the work tree's objects (nothing is copied), for
    tests that read history (``git archive`` of an older release)."""
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    objects = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--path-format=absolute", "--git-common-dir"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (tree / ".git" / "objects" / "info" / "alternates").write_text(f"{objects}/objects\n")


def scratch_python(tree: Path) -> Path:
    """A venv in ``tree`` whose ``sys.path`` puts the tree's sources before the work tree's
    ``.venv`` packages (which stay where they are), with a ``spotrl`` script of its own."""
    venv = tree / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    parent = Path(sysconfig.get_path("purelib"))
    (purelib / "00-scratch.pth").write_text("".join(f"{tree / d}\n" for d in SOURCE_DIRS))
    (purelib / "zz-parent.pth").write_text(f"import site; site.addsitedir({str(parent)!r})\n")
    python = venv / "bin" / "python"
    script = venv / "bin" / "spotrl"
    script.write_text(f"#!{python}\nimport sys\nfrom spotrl_runtime.cli import main\nsys.exit(main())\n")
    script.chmod(0o755)
    return python


def run_one(mutation: Mutation, keep: bool) -> tuple[str, float]:
    started = time.monotonic()
    tree = Path(tempfile.mkdtemp(prefix=f"spotrl-mutation-{mutation.path.stem}-"))
    try:
        copy_tree(tree)
        applied = subprocess.run(["git", "apply", str(mutation.path)], cwd=tree, capture_output=True, text=True)
        if applied.returncode:
            return f"does not apply: {applied.stderr.strip().splitlines()[0]}", time.monotonic() - started
        share_history(tree)
        python = scratch_python(tree)
        env = {**os.environ, "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        env.pop("PYTHONPATH", None)
        LOGS.mkdir(parents=True, exist_ok=True)
        junit = LOGS / f"{mutation.path.stem}.xml"
        junit.unlink(missing_ok=True)
        args = [str(python), "-m", "pytest", *mutation.tests, "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
        with open(LOGS / f"{mutation.path.stem}.log", "w") as log:
            code = subprocess.run(args, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        return verdict(code, junit.read_text() if junit.exists() else None), time.monotonic() - started
    finally:
        if keep:
            print(f"kept {tree}", file=sys.stderr)
        else:
            shutil.rmtree(tree, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("patches", nargs="*", type=Path, help="patches to run (default: every tests/mutations/*.patch)")
    parser.add_argument("--keep", action="store_true", help="keep each scratch copy (its path goes to stderr)")
    args = parser.parse_args(argv)
    paths = args.patches or sorted(MUTATIONS.glob("*.patch"))
    mutations = [parse(p, p.read_text()) for p in paths]
    failed = 0
    print(f"{'patch':<40} {'verdict':<24} {'seconds':>7}  tests")
    for m in mutations:
        said, seconds = run_one(m, args.keep)
        failed += not said.startswith("killed")
        print(f"{m.path.name:<40} {said:<24} {seconds:7.0f}  {' '.join(m.tests)}", flush=True)
    print(f"{len(mutations) - failed} of {len(mutations)} mutations killed by their tests")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
