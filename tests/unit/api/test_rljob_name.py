"""metadata.name: what Kubernetes accepts as an object name, and so nothing that leaves a folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from spotrl_runtime.api.rljob import SpecError, parse_rljob

EXAMPLE = yaml.safe_load((Path(__file__).resolve().parents[3] / "examples/tiny-cpu.yaml").read_text())


def named(metadata: Any) -> dict[str, Any]:
    return {**EXAMPLE, "metadata": metadata}


@pytest.mark.parametrize("name", ["tiny", "tiny-arith", "a", "job.v2", "0-start-with-digit", "a" * 253])
def test_dns_subdomain_names_are_accepted(name: str) -> None:
    assert parse_rljob(named({"name": name})).name == name


def test_a_document_without_a_name_is_accepted() -> None:
    assert parse_rljob(named({})).name == ""


@pytest.mark.parametrize(
    "name",
    ["../../tmp/x", "a/b", "..", ".", "", "Tiny", "tiny_job", "-tiny", "tiny-", "a..b", "tiny\n", "a" * 254, 7, None],
)
def test_other_names_are_refused_naming_the_field(name: Any) -> None:
    with pytest.raises(SpecError) as err:
        parse_rljob(named({"name": name}))
    ((path, message),) = err.value.problems
    assert path == "metadata.name"
    assert "DNS-1123 subdomain" in message


def test_metadata_must_be_a_mapping() -> None:
    with pytest.raises(SpecError) as err:
        parse_rljob(named(["name", "x"]))
    assert err.value.problems == [("metadata", "must be a mapping")]
