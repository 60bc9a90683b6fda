"""The distribution's shape: nothing shadows the standard library, extras stay apart."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
from importlib import metadata

from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_operator_folder_does_not_shadow_the_stdlib_operator_module() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import operator; print(operator.add(1, 2))"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "3"
    assert not (ROOT / "operator" / "__init__.py").exists()


def _closure(extras: set[str]) -> set[str]:
    """Names of every distribution `pip install spotrl[extras]` pulls, from installed metadata."""
    seen: set[str] = set()
    todo = [(Requirement(r), extras) for r in metadata.requires("spotrl") or []]
    while todo:
        req, active = todo.pop()
        if req.marker and not any(req.marker.evaluate({"extra": e}) for e in (active or {""})):
            continue
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [(Requirement(r), set(req.extras)) for r in requires]
    return seen


def test_installing_the_operator_does_not_pull_torch() -> None:
    operator_deps = _closure({"operator"})
    assert "kopf" in operator_deps
    assert "kubernetes" in operator_deps
    assert not operator_deps & {"torch", "transformers", "ray", "vllm", "torchdata"}
    assert "torch" in _closure({"runtime"})


def test_every_dependency_is_pinned_in_constraints() -> None:
    pinned = {
        re.sub(r"[-_.]+", "-", line.split("==")[0]).lower()
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    }
    for extra in ("operator", "runtime", "gpu", "dev"):
        missing = {n for n in _closure({extra}) if n != "spotrl"} - pinned
        assert not missing, f"{extra}: not pinned in constraints.txt: {sorted(missing)}; run `make lock`"
    assert re.search(r"^python-dateutil==2\.", (ROOT / "constraints.txt").read_text(), re.M)


def test_no_two_test_modules_share_a_basename() -> None:
    """pytest imports test modules by basename (rootdir mode, no __init__.py): two files named
    alike in different folders fail collection in a clean clone ("import file mismatch"), which
    a checkout with warm __pycache__ folders can hide."""
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def _imported(package: str) -> dict[str, set[str]]:
    """For each module of ``spotrl_runtime.<package>``: the spotrl_runtime packages it imports
    (at the top or inside a function)."""
    package = f"spotrl_runtime.{package}"
    return {
        name: {m.split(".")[1] for m in deps}
        for name, deps in _module_imports().items()
        if name == package or name.startswith(f"{package}.")
    }


def test_the_checkpoint_package_does_not_import_the_training_package() -> None:
    """training/ lends its tensors to checkpoint/ (cuts, restore, redo), never the other way
    round, so the two never import each other in a circle."""
    offenders = {name: deps for name, deps in _imported("checkpoint").items() if "training" in deps}
    assert offenders == {}
    assert any("checkpoint" in deps for deps in _imported("training").values()), "the check sees imports at all"


KNOWN_CIRCLES = {
    ("spotrl_runtime.controller.assemble", "spotrl_runtime.controller.loop"),
    ("spotrl_runtime.controller.kube_bridge", "spotrl_runtime.controller.standby"),
    ("spotrl_runtime.models.loading", "spotrl_runtime.models.lora"),
    ("spotrl_runtime.training.fsdp", "spotrl_runtime.training.group"),
}
"""Pairs of modules that import each other today (one of them inside a function). The list may
only shrink: take a pair out when it is untangled."""


def _module_imports() -> dict[str, set[str]]:
    """Every spotrl_runtime module: the spotrl_runtime modules it imports, anywhere in it."""
    import ast

    root = ROOT / "runtime"
    modules = {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
        for p in (root / "spotrl_runtime").rglob("*.py")
    }
    out: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.update(
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                    for a in node.names
                )
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        out[name] = {m for m in found if m in modules and m != name}
    return out


def test_no_two_modules_import_each_other_beyond_the_known_pairs() -> None:
    """A new pair of modules importing each other (even inside a function) fails here: move
    what both need into a third module, or import one way only."""
    imports = _module_imports()
    circles = {tuple(sorted((a, b))) for a, deps in imports.items() for b in deps if a in imports[b]}
    assert circles - KNOWN_CIRCLES == set(), "a new import circle"
    assert KNOWN_CIRCLES - circles == set(), "a known circle is gone: take it out of KNOWN_CIRCLES"
    assert "spotrl_runtime.rollouts.episodes" in imports["spotrl_runtime.generation.worker"], "the check sees imports"
