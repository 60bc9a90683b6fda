"""`make test-changed`'s choice of tests (spotrl_e2e.changed.select): pure, on a made-up tree."""

from __future__ import annotations

from spotrl_e2e.changed import module_of, select

TESTS = {
    "tests/unit/checkpoint/test_fence_unit.py": "from spotrl_runtime.checkpoint.fence import Fence\n",
    "tests/integration/checkpoint/test_cuts.py": "from spotrl_runtime.checkpoint import fence, layout\n",
    "tests/integration/controller/test_run.py": "import subprocess\n",
    "tests/integration/controller/controller_runs.py": "from spotrl_runtime.storage import open_storage\n",
    "tests/unit/storage/test_local.py": "from spotrl_runtime.storage.local import LocalStorage\n",
    "tests/unit/operator/test_reconcile.py": "from spotrl_operator import reconcile\n",
    "tests/e2e/test_chart.py": "",
    "tests/e2e/test_operator.py": "",
    "tests/security/test_scanners.py": "",
    "tests/cluster/test_crd.py": "",
    "tests/unit/api/test_model.py": "",
    "tests/unit/test_durations_report.py": "from spotrl_e2e.durations import main\n",
    "tests/unit/test_docs.py": "",
    "tests/cluster/test_docs_manifests.py": "",
}


def test_a_module_selects_its_area_and_the_tests_that_import_it() -> None:
    got = select(["runtime/spotrl_runtime/checkpoint/fence.py"], TESTS)
    assert list(got) == ["tests/unit/checkpoint", "tests/integration/checkpoint"]
    got = select(["runtime/spotrl_runtime/storage/local.py"], TESTS)
    assert list(got) == ["tests/unit/storage"]
    # a test elsewhere that imports it by `from parent import leaf`
    assert "tests/unit/test_durations_report.py" in select(["e2e/spotrl_e2e/durations.py"], TESTS)


def test_the_controllers_code_selects_the_controller_runs_and_the_operator_its_e2e() -> None:
    assert "tests/integration/controller" in select(["runtime/spotrl_runtime/controller/loop.py"], TESTS)
    assert "tests/integration/controller" not in select(["runtime/spotrl_runtime/storage/local.py"], TESTS)
    got = select(["operator/spotrl_operator/reconcile.py"], TESTS)
    assert list(got) == ["tests/unit/operator", "tests/e2e"]


def test_tests_helpers_chart_crd_docs_and_the_build() -> None:
    assert list(select(["tests/e2e/test_operator.py"], TESTS)) == ["tests/e2e/test_operator.py"]
    assert list(select(["tests/integration/controller/controller_runs.py"], TESTS)) == ["tests/integration/controller"]
    assert list(select(["charts/spotrl/values.yaml"], TESTS)) == ["tests/e2e/test_chart.py", "tests/security"]
    assert list(select(["crds/rljob.yaml"], TESTS)) == ["tests/cluster/test_crd.py", "tests/unit/api"]
    assert select(["examples/tiny-cpu.yaml"], TESTS) == {}
    docs = ["tests/unit/test_docs.py", "tests/cluster/test_docs_manifests.py"]
    for page in ("README.md", "docs/operations/karpenter.md", "mkdocs.yml"):
        assert list(select([page], TESTS)) == docs, page
    assert list(select(["README.md", "constraints.txt", "tests/e2e/test_chart.py"], TESTS)) == ["tests"]


def test_a_folder_covers_its_files() -> None:
    got = select(["tests/e2e/test_chart.py", "operator/spotrl_operator/reconcile.py"], TESTS)
    assert "tests/e2e/test_chart.py" not in got
    assert "tests/e2e" in got


def test_module_names() -> None:
    assert module_of("runtime/spotrl_runtime/checkpoint/fence.py") == ("spotrl_runtime.checkpoint.fence", "checkpoint")
    assert module_of("runtime/spotrl_runtime/cli.py") == ("spotrl_runtime.cli", "cli")
    assert module_of("operator/spotrl_operator/handlers.py") == ("spotrl_operator.handlers", "operator")
    assert module_of("runtime/spotrl_runtime/storage/__init__.py") == ("spotrl_runtime.storage", "storage")
    assert module_of("README.md") is None
