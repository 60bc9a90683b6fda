"""The resume's precheck (checkpoint/precheck.py), on a real cut broken in every way the
validation chain names: it refuses only what the restore refuses, with the restore's own
error, never something the restore would take or would skip for an older cut; and it
imports neither torch nor Ray."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cut_scenarios import EXAMPLE_B, JOB, example_b_before_cut, loader_for
from test_validation_chain import CASES, Breaker, _dataset, break_flip_byte, encode

from spotrl_e2e.forgery import CutSurgery
from spotrl_runtime.checkpoint import restore_cut
from spotrl_runtime.checkpoint.precheck import ResumeError, precheck_resume
from spotrl_runtime.core import validation as v
from spotrl_runtime.core.identity import JobIdentity
from spotrl_runtime.data import PromptCollate
from spotrl_runtime.storage import LocalStorage, StorageError

# What the precheck cannot see: the dataset's checks and the prompt tokens (they need torch
# and the tokenizer), a flipped byte in the weights (it checks their size, not their digest),
# and the policy's identity (an adapter's default targets and its base's digest need the model).
UNSEEN = {*v.DATASET_CHECKS, "rollout_prompt_tokens", "file_digest", "policy_identity"}


@pytest.fixture
def cut_root(tmp_path: Path) -> Path:
    root = tmp_path / "job"
    run = example_b_before_cut(LocalStorage(root))
    run.finish("g3", (0,))
    run.cut()
    return root


def _restore_error(root: Path, cut_id: str, restore_kw: dict[str, Any], tmp_path: Path) -> v.CutCheckError | None:
    dataset = _dataset(restore_kw.get("dataset"), tmp_path)
    try:
        restore_cut(
            LocalStorage(root),
            dataset=dataset,
            collate=PromptCollate(),
            source=loader_for(EXAMPLE_B, dataset),
            cut_id=cut_id,
            expect=restore_kw.get("expect"),
            encode=encode,
        )
    except v.CutCheckError as err:
        return err
    return None


def _precheck(root: Path, resume: str, restore_kw: dict[str, Any]) -> tuple[str | None, v.CutCheckError | None]:
    expect = restore_kw.get("expect") or v.Expectations()
    job = JobIdentity(expect.job or JOB)
    try:
        return precheck_resume(LocalStorage(root), job=job, config=expect.config or EXAMPLE_B, resume=resume), None
    except v.CutCheckError as err:
        return None, err


@pytest.mark.parametrize(("check", "breaker", "verify_args", "restore_kw"), CASES, ids=[c for c, *_ in CASES])
def test_the_precheck_refuses_what_the_restore_refuses_with_its_error(
    check: str,
    breaker: Breaker,
    verify_args: list[str] | None,
    restore_kw: dict[str, Any],
    cut_root: Path,
    tmp_path: Path,
) -> None:
    surgery = CutSurgery.only_cut(cut_root)
    breaker(surgery, tmp_path)
    cut_id = surgery.cut.name
    restored = _restore_error(cut_root, cut_id, restore_kw, tmp_path)
    assert restored is not None
    assert restored.check == check

    named, named_err = _precheck(cut_root, cut_id, restore_kw)
    if check in UNSEEN or "dataset" in restore_kw:
        assert named_err is None, f"the precheck refused what it cannot see: {named_err}"
        assert named == cut_id
    else:
        assert named_err is not None, f"the precheck let {check} through to the restore"
        assert named_err.check == check
        if check != "job_identity":  # the store's owner is checked first, as resume_or_start does
            assert str(named_err) == str(restored)

    # --resume auto: a cut that a byte-level check refuses is the restore's to skip, not refused
    # here; a cut without its manifest is none (auto starts a new run).
    auto, auto_err = _precheck(cut_root, "auto", restore_kw)
    if check in v.BYTE_LEVEL_CHECKS or check == "manifest_present" or named_err is None:
        assert auto_err is None
    else:
        assert auto_err is not None
        assert str(auto_err) == str(named_err)
    if check in ("manifest_present", "manifest_parses"):
        assert auto is None  # no committed cut to take, or the restore's to skip


def test_a_forged_cut_whose_weights_are_damaged_too_is_left_for_the_restore_to_skip(
    cut_root: Path, tmp_path: Path
) -> None:
    """Under --resume auto the restore skips a cut with a damaged file for an older one; the
    precheck, which does not hash the weights, must not refuse such a cut for its forgery."""
    surgery = CutSurgery.only_cut(cut_root)
    surgery.edit_json("sampler", lambda d: d.update(retired=[]))  # coverage, digests recomputed
    assert _precheck(cut_root, surgery.cut.name, {})[1] is not None  # refused by name
    break_flip_byte(surgery)
    assert _precheck(cut_root, "auto", {}) == (None, None)
    assert _restore_error(cut_root, surgery.cut.name, {}, tmp_path).check == "file_digest"  # type: ignore[union-attr]


def test_resume_never_on_a_store_with_cuts_and_a_store_of_another_job(cut_root: Path) -> None:
    with pytest.raises(ResumeError, match="already holds cuts"):
        precheck_resume(LocalStorage(cut_root), job=JobIdentity(JOB), config=EXAMPLE_B, resume="never")
    with pytest.raises(v.ForeignCutError, match="not 'someone/else'"):
        precheck_resume(LocalStorage(cut_root), job=JobIdentity("someone/else"), config=EXAMPLE_B, resume="auto")
    newest = CutSurgery.only_cut(cut_root).cut.name
    assert precheck_resume(LocalStorage(cut_root), job=JobIdentity(JOB), config=EXAMPLE_B, resume="auto") == newest
    empty = LocalStorage(cut_root.parent / "empty")
    assert precheck_resume(empty, job=JobIdentity(JOB), config=EXAMPLE_B, resume="never") is None
    assert precheck_resume(empty, job=JobIdentity(JOB), config=EXAMPLE_B, resume="auto") is None
    assert not (cut_root.parent / "empty").exists(), "the precheck writes nothing"


class _Unreachable(LocalStorage):
    """A store whose every read fails, as an S3 endpoint that is down."""

    def get_bytes(self, key: str) -> bytes:
        raise StorageError(f"{key}: connection refused")

    def head(self, key: str) -> Any:
        raise StorageError(f"{key}: connection refused")

    def list(self, prefix: str) -> Any:
        raise StorageError(f"{prefix}: connection refused")


def test_a_store_it_cannot_read_is_left_for_the_restore(cut_root: Path) -> None:
    store = _Unreachable(cut_root)
    assert precheck_resume(store, job=JobIdentity(JOB), config=EXAMPLE_B, resume="auto") is None


def test_the_precheck_imports_neither_torch_nor_ray(cut_root: Path) -> None:
    code = (
        "import sys, json\n"
        "from spotrl_runtime.checkpoint.precheck import precheck_resume\n"
        "from spotrl_runtime.core.identity import JobIdentity\n"
        "from spotrl_runtime.core.owners import RecoveryConfig\n"
        "from spotrl_runtime.storage import open_storage\n"
        "config = RecoveryConfig(group_size=2, prompts_per_step=3, lookahead=2, on_dropped_prompt='replace',"
        " spare_pool_batches=1)\n"
        f"cut = precheck_resume(open_storage({str(cut_root)!r}), job=JobIdentity({JOB!r}), config=config,"
        " resume='auto')\n"
        "print(json.dumps([cut, sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules)]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    cut, heavy = json.loads(out.stdout)
    assert cut == CutSurgery.only_cut(cut_root).cut.name
    assert heavy == []
