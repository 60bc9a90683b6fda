"""Every check a delta cut must pass, on a real delta (the scenario run: real owners, loader,
cut writer and restore, a tiny torch trainer) broken in that way alone, digests recomputed:
restore (and the redo) refuses it with the named error, and `spotrl ckpt verify` names the check.
The controller's own deltas meet the same forgeries in tests/integration/controller/test_delta_cuts.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cut_scenarios import DATASET, EXAMPLE_B, Run, loader_for

from spotrl_e2e.forgery import (
    CutSurgery,
    base_of_another_job,
    base_refused_by_its_chain,
    delta_base,
    drop_a_redo_row,
    drop_a_redo_step,
    edit_the_base,
    rebase,
    remove_the_base,
    swap_two_redo_groups,
)
from spotrl_runtime.checkpoint import restore_cut
from spotrl_runtime.checkpoint.layout import list_cut_folders
from spotrl_runtime.checkpoint.resume import redo
from spotrl_runtime.cli import main as spotrl
from spotrl_runtime.core import validation as v
from spotrl_runtime.core.redo import StepFingerprint
from spotrl_runtime.core.types import FinishedGroup
from spotrl_runtime.data import PromptCollate
from spotrl_runtime.storage import LocalStorage


@pytest.fixture
def delta_root(tmp_path: Path) -> Path:
    """A full cut at step 2, then a delta at step 4 on it (redo steps 2 and 3, three groups each)."""
    root = tmp_path / "job"
    run = Run.new(EXAMPLE_B, DATASET, LocalStorage(root))
    run.drain(2)
    assert not run.cut().manifest.is_delta
    run.drain(4)
    delta = run.cut("delta")
    assert delta.manifest.is_delta
    assert delta.manifest.base is not None
    assert delta.manifest.base.trainer_step == 2
    return root


def _delta(root: Path) -> CutSurgery:
    return CutSurgery(root / "cuts" / list_cut_folders(LocalStorage(root))[-1].cut_id)


def restamp_a_redo_group(c: CutSurgery) -> None:
    c.edit_json("redo_index", lambda d: d["steps"][0]["groups"][0].update(target_step=3))


def base_a_delta(c: CutSurgery) -> None:
    base = delta_base(c)
    base.m.update(form="delta", trainer_format=None, base=dict(c.m["base"]))
    base.save_manifest()
    rebase(c)


Breaker = Callable[[CutSurgery], Any]
CASES: list[tuple[str, str, Breaker]] = [
    ("redo_steps", "a step missing", drop_a_redo_step),
    ("redo_rows", "a row missing", drop_a_redo_row),
    ("redo_rows", "a group redone at another step than its stamp", restamp_a_redo_group),
    ("redo_audit", "two groups in another order than trained", swap_two_redo_groups),
    ("delta_base", "the base gone", remove_the_base),
    ("delta_base", "the base's manifest changed", edit_the_base),
    ("delta_base", "the base of another job", base_of_another_job),
    ("delta_base", "the base refused by its own chain", base_refused_by_its_chain),
    ("delta_base", "the base a delta itself", base_a_delta),
]


def test_every_delta_check_has_a_case() -> None:
    assert {c for c, *_ in CASES} | {"redo_fingerprint"} == v.DELTA_CHECKS | {"redo_fingerprint"}


def _restore(root: Path) -> Any:
    return restore_cut(
        LocalStorage(root),
        dataset=DATASET,
        collate=PromptCollate(),
        source=loader_for(EXAMPLE_B, DATASET),
        expect=v.Expectations(job="default/scenario", config=EXAMPLE_B),
    )


@pytest.mark.parametrize(("check", "what", "breaker"), CASES, ids=[w for _, w, _ in CASES])
def test_a_broken_delta_is_refused_with_the_named_check(
    check: str, what: str, breaker: Breaker, delta_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    delta = _delta(delta_root)
    breaker(delta)
    error = next(e for e in v.ERRORS if e.check == check)
    with pytest.raises(error) as info:
        _restore(delta_root)
    assert delta.cut.name in str(info.value), "the error names the delta"
    rc = spotrl(["ckpt", "verify", str(delta.cut), "--job", "default/scenario"])
    assert rc == 1
    assert f"FAILED check {check}:" in capsys.readouterr().err


class _Trainer:
    """The scenario run's trainer as the redo drives it (step, train_step, fingerprint)."""

    def __init__(self, run: Run, step: int):
        self.run = run
        self.step = step
        self.last: StepFingerprint | None = None

    def train_step(self, groups: list[FinishedGroup]) -> dict[str, float]:
        self.last = self.run._step(groups)
        self.step += 1
        return {}

    def fingerprint(self, metrics: dict[str, float]) -> StepFingerprint:
        assert self.last is not None
        return self.last


def test_a_redo_that_does_not_reproduce_a_step_is_refused_and_the_untouched_one_passes(delta_root: Path) -> None:
    restored = _restore(delta_root)
    base = restored.base.trainer_step

    def fresh() -> _Trainer:
        run = Run.restore(EXAMPLE_B, DATASET, LocalStorage(delta_root), cut_id=restored.base.cut_id)
        return _Trainer(run, base)

    trainer = fresh()
    redo(trainer, restored)
    assert trainer.step == restored.owners.trainer_step

    delta = _delta(delta_root)
    delta.edit_json("redo_index", lambda d: d["steps"][-1]["fingerprint"].update(params="0" * 32))
    with pytest.raises(v.RedoFingerprintError) as info:
        # The trainer's RNG first, then a restore (its loader has an RNG of its own: not the trainer's).
        redo(fresh(), _restore(delta_root))
    assert f"redo step {restored.owners.trainer_step - 1}" in str(info.value)
    assert "params" in str(info.value)
    assert json.loads(delta.manifest_path.read_text())["form"] == "delta"
