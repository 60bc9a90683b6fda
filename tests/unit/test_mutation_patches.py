"""The mutation patches of ``make mutations`` stay runnable: each still applies to today's tree and
names tests that exist, so a patch that rotted is seen in CI, not on the day someone runs them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from spotrl_e2e.mutations import MUTATIONS, ROOT, PatchError, parse, verdict

PATCHES = sorted(MUTATIONS.glob("*.patch"))


def test_there_are_mutations_to_run() -> None:
    assert PATCHES, f"no patches in {MUTATIONS}"


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_each_patch_applies_to_the_tree_and_names_tests_that_exist(patch: Path) -> None:
    mutation = parse(patch, patch.read_text())
    check = subprocess.run(["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True, text=True)
    assert check.returncode == 0, f"{patch.name} no longer applies: {check.stderr}"
    for node in mutation.tests:
        file, _, name = node.partition("::")
        assert (ROOT / file).is_file(), f"{patch.name}: {file} does not exist"
        function = re.sub(r"\[.*\]$", "", name.split("::")[-1])
        assert not function or re.search(rf"def {re.escape(function)}\b", (ROOT / file).read_text()), (
            f"{patch.name}: no test {function} in {file}"
        )
    touched = re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), flags=re.M)
    assert touched, f"{patch.name} changes no file"
    assert not [t for t in touched if t.startswith("tests/")], (
        f"{patch.name}: a mutation breaks the code under test, not a test ({touched})"
    )


def test_a_header_must_name_its_tests_and_its_claim() -> None:
    diff = "diff --git a/x b/x\n# test: tests/late.py::t\n"
    with pytest.raises(PatchError, match="no '# test:"):
        parse(Path("p.patch"), "# claim: breaks x\n" + diff)
    with pytest.raises(PatchError, match="no '# claim:"):
        parse(Path("p.patch"), "# test: tests/a.py::t\n" + diff)
    with pytest.raises(PatchError, match="not a node id under tests/"):
        parse(Path("p.patch"), "# test: a.py::t\n# claim: c\n" + diff)
    m = parse(Path("p.patch"), "# test: tests/a.py::t\n# test: tests/b.py::u[x]\n# claim: c\n" + diff)
    assert m.tests == ("tests/a.py::t", "tests/b.py::u[x]")
    assert m.claim == "c"


def junit(*outcomes: str) -> str:
    cases = "".join(f'<testcase name="t{i}">{f"<{o}/>" if o else ""}</testcase>' for i, o in enumerate(outcomes))
    return f"<testsuites><testsuite>{cases}</testsuite></testsuites>"


def test_only_tests_that_fail_in_their_bodies_kill_a_mutation() -> None:
    assert verdict(1, junit("failure", "failure")) == "killed"
    assert verdict(1, junit("failure", "")) == "killed by 1 of 2"
    assert verdict(0, junit("", "")) == "SURVIVED"
    assert verdict(1, junit("error", "")).startswith("no verdict (a fixture errored"), "a fixture that broke"
    for broken_run in (2, 4, 5):
        assert verdict(broken_run, None).startswith("no verdict")
