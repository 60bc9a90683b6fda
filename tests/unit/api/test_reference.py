"""The generated reference pages hold everything their source has: every status phase, command,
flag, Helm value, metric and check (``make lint`` then keeps them current)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import get_args

from spotrl_runtime.api import reference
from spotrl_runtime.api.rljob import RLJobStatus

REPO = Path(__file__).resolve().parents[3]


def test_the_rljob_page_lists_the_status_with_every_phase() -> None:
    page = reference.rljob_page()
    (phase_row,) = [line for line in page.splitlines() if line.startswith("| `status.phase` |")]
    literal, _ = get_args(RLJobStatus.model_fields["phase"].annotation)  # Optional[Literal[...]]
    assert "Queued" in get_args(literal)
    for phase in get_args(literal):
        assert f"`{phase}`" in phase_row, phase
    assert "| `spec.runtimeEnv[].valueFrom.secretKeyRef` |" in page, "list items are walked"
    assert "- `spec.runtimeEnv[].name`: names starting with SPOTRL_" in page, "and their rules listed"
    assert "status.kopf." not in page, "Kopf's own bookkeeping is not the API"


def test_the_cli_page_has_every_command_and_flag() -> None:
    from spotrl_runtime.cli import build_parser

    page = reference.cli_page()
    for name, parser in reference._commands(build_parser(), "spotrl"):
        assert f"## `{name}`" in page
        for action in parser._actions:
            for flag in action.option_strings:
                assert flag in page, (name, flag)
    assert "## `spotrl ckpt export`" in page


def test_helm_values_are_read_with_the_comment_right_above_or_after_them() -> None:
    text = """# A file's header, then a blank line: nobody's.

# The section's note.
image:
  # The repository.
  repository: spotrl-operator
  tag: ""  # default: appVersion
  pullPolicy: IfNotPresent
list:
  - a
after: 1
"""
    assert reference.helm_values(text) == [
        ("image", "", "The section's note."),
        ("image.repository", "spotrl-operator", "The repository."),
        ("image.tag", '""', "default: appVersion"),
        ("image.pullPolicy", "IfNotPresent", ""),
        ("after", "1", ""),
    ]


def test_the_operator_page_has_every_flag_and_every_value_of_the_chart() -> None:
    from spotrl_operator.settings import add_arguments

    page = reference.operator_page(REPO)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for action in parser._actions:
        for flag in action.option_strings:
            if flag not in ("-h", "--help"):
                assert f"`{flag}`" in page, flag
    for path, _, _ in reference.helm_values((REPO / reference.VALUES_FILE).read_text()):
        assert f"| `{path}` |" in page, path
    assert "| `runtimePods.doNotDisrupt` | `true` | boolean |" in page, "with the type values.schema.json gives it"
    assert "| `metrics.port` | `9400` | integer (≥ 1, ≤ 65535) |" in page
    assert "| `resources.requests.cpu` | `100m` | Kubernetes quantity |" in page


def test_the_metrics_page_has_every_metric_of_the_controller_and_the_operator() -> None:
    from spotrl_runtime.controller.metrics import STEP_GAUGES

    page = reference.metrics_page()
    for name in STEP_GAUGES:
        assert f"`spotrl_{name}`" in page, name
    for name in ("spotrl_val_accuracy", "spotrl_rollout_probs_diff_max", "spotrl_cuts_total"):
        assert f"`{name}`" in page, name
    assert "`spotrl_operator_leader`" in page
    assert "`spotrl_operator_barriers_committed_total`" in page


def test_the_checks_page_lists_the_chain_in_its_order() -> None:
    from spotrl_runtime.core.validation import CHECKS

    page = reference.validation_page()
    rows = [line.split("|")[2].strip(" `") for line in page.splitlines() if line.startswith("| ") and "`" in line]
    assert rows == list(CHECKS)
