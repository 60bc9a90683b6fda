"""A validation pass's requests (controller/validation.py): each asks for the version it scores,
and each yields to weight loads, so the pool never holds a sync up for a pass (the worker
holding its groups is left out of the sync and finishes them on that version)."""

from __future__ import annotations

from pathlib import Path

import yaml

from spotrl_runtime.api.rljob import parse_rljob
from spotrl_runtime.controller.validation import Validator

ROOT = Path(__file__).resolve().parents[2]


def test_a_pass_asks_for_the_version_it_scores_and_yields_to_every_load() -> None:
    doc = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    doc["spec"]["validation"] = {"dataset": "builtin:arithmetic", "everySteps": 4, "limit": 8}
    validator = Validator(parse_rljob(doc).spec, lambda prompt: tuple(ord(c) for c in prompt.text), reward=None)
    assert validator.due(3) == [], "not a multiple of everySteps"
    requests = validator.due(4)
    assert len(requests) == 8
    assert {(r.weight_version, r.yields) for r in requests} == {(4, True)}
    assert all(Validator.owns(r.group_id) for r in requests)
    assert validator.due(8) == [], "one pass at a time"
