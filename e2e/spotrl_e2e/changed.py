"""``make test-changed``: the test files that a change touches, so that a developer runs those
in minutes instead of the whole suite.

What a changed file selects (:func:`select`):

- a test file: itself; a test folder's ``conftest.py`` or helper: that folder;
- a module of ours: see below; a helper of the tests that imports it selects its folder;
- a module of ours (``runtime/spotrl_runtime/...``, ``operator/spotrl_operator/...``,
  ``e2e/spotrl_e2e/...``): the tests of its area (``tests/unit/<area>``,
  ``tests/integration/<area>``) and every test file that names it in an import;
- the controller's own code (``controller/``, ``commands/``, ``cli.py``, the reaper):
  ``tests/integration/controller`` too, which runs it as users do;
- the operator: ``tests/e2e`` too; the chart: ``tests/e2e/test_chart.py`` and ``tests/security``;
  the CRD: ``tests/cluster/test_crd.py`` and ``tests/unit/api``;
- what builds or pins everything (``pyproject.toml``, ``constraints.txt``, ``Makefile``,
  ``.ci/run``, ``e2e/toolchain``, ``e2e/kind``, the ``Dockerfile``): all of ``tests``;
- anything else (docs, examples): nothing.

The changes are those against ``BASE`` (default ``origin/main`` when it exists, else ``HEAD``):
committed, staged, unstaged and untracked. ``python -m spotrl_e2e.changed`` prints the
selection, one path a line, and why on stderr.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import PurePosixPath

PACKAGES = {
    "runtime/spotrl_runtime": "spotrl_runtime",
    "operator/spotrl_operator": "spotrl_operator",
    "e2e/spotrl_e2e": "spotrl_e2e",
}
EVERYTHING = ("pyproject.toml", "constraints.txt", "Makefile", ".ci/", "e2e/toolchain/", "e2e/kind/", "Dockerfile")
RUN_AS_USERS = ("controller", "commands", "cli", "reaper", "processes")
"""Areas of spotrl_runtime that `spotrl run` is: tests/integration/controller runs them."""


def module_of(path: str) -> tuple[str, str] | None:
    """(dotted module, area) of one of our source files; None for anything else.
    ``runtime/spotrl_runtime/checkpoint/fence.py`` is (``spotrl_runtime.checkpoint.fence``, ``checkpoint``)."""
    for folder, package in PACKAGES.items():
        if path.startswith(folder + "/") and path.endswith(".py"):
            parts = list(PurePosixPath(path[len(folder) + 1 :]).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            area = parts[0] if parts else ""
            if package == "spotrl_operator":
                area = "operator"
            return ".".join([package, *parts]), area
    return None


def _imports(text: str, module: str) -> bool:
    parent, _, leaf = module.rpartition(".")
    if re.search(rf"\b{re.escape(module)}\b", text):
        return True
    return bool(parent and re.search(rf"from {re.escape(parent)} import [^\n]*\b{re.escape(leaf)}\b", text))


def _is_test(path: str) -> bool:
    return PurePosixPath(path).name.startswith("test_")


def select(changed: Iterable[str], tests: Mapping[str, str]) -> dict[str, str]:
    """Test paths to run (a file or a folder) and why, for ``changed`` files; ``tests`` maps
    each test file's path to its text. Pure: no I/O."""
    folders = {str(PurePosixPath(t).parent) for t in tests}
    out: dict[str, str] = {}

    def add(path: str, why: str) -> None:
        if path in tests or path in folders or path == "tests":
            out.setdefault(path, why)

    for path in changed:
        if path.startswith(EVERYTHING) or path in EVERYTHING:
            add("tests", f"{path} builds or pins everything")
        elif path.startswith("tests/"):
            if _is_test(path):
                add(path, "changed")
            else:
                add(str(PurePosixPath(path).parent), f"{path} (a helper or conftest) changed")
        elif path.startswith("charts/"):
            add("tests/e2e/test_chart.py", f"{path}: the chart")
            add("tests/security", f"{path}: the chart is scanned")
        elif path.startswith("docs/") or path in ("README.md", "CONTRIBUTING.md", "mkdocs.yml"):
            add("tests/unit/test_docs.py", f"{path}: the docs")
            add("tests/cluster/test_docs_manifests.py", f"{path}: the docs' manifests")
        elif path.startswith("crds/"):
            add("tests/cluster/test_crd.py", f"{path}: the CRD")
            add("tests/unit/api", f"{path}: the CRD")
        elif (found := module_of(path)) is not None:
            module, area = found
            add(f"tests/unit/{area}", f"{path}: its area")
            add(f"tests/integration/{area}", f"{path}: its area")
            if module.startswith("spotrl_runtime.") and area in RUN_AS_USERS:
                add("tests/integration/controller", f"{path}: `spotrl run` runs it")
            if area == "operator":
                add("tests/e2e", f"{path}: the operator, end to end")
            for test, text in sorted(tests.items()):
                if _imports(text, module):
                    # a helper's importers are the tests of its folder
                    add(test if _is_test(test) else str(PurePosixPath(test).parent), f"imports {module}")
    if "tests" in out:
        return {"tests": out["tests"]}
    # A folder selected covers the files in it.
    return {p: why for p, why in out.items() if not any(p.startswith(q + "/") for q in out)}


def _git(*args: str) -> list[str]:
    out = subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line]


def changed_files(base: str | None) -> list[str]:
    if base is None:
        known = subprocess.run(["git", "rev-parse", "-q", "--verify", "origin/main"], capture_output=True)
        base = "origin/main" if known.returncode == 0 else "HEAD"
    files = _git("diff", "--name-only", base) + _git("ls-files", "--others", "--exclude-standard")
    return sorted(set(files))


def main(argv: list[str] | None = None) -> int:
    import argparse
    from pathlib import Path

    p = argparse.ArgumentParser(prog="python -m spotrl_e2e.changed", description=__doc__)
    p.add_argument("--base", help="what to compare with (default origin/main, else HEAD)")
    args = p.parse_args(argv)
    tests = {str(f): f.read_text() for f in Path("tests").rglob("*.py")}
    picked = select(changed_files(args.base), tests)
    for path, why in picked.items():
        print(f"test-changed: {path}  ({why})", file=sys.stderr)
    if not picked:
        print("test-changed: nothing to run for this change", file=sys.stderr)
    print("\n".join(picked))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
