"""The redo log and the delta cut's format and choice, as pure logic: the owners keep each trained
step (with its fingerprint) until a full cut holds it; a delta's files round-trip; a manifest says
what it holds and nothing else; the barrier cuts a delta only when it should."""

from __future__ import annotations

import json

import pytest
from scripted_generation import new_owners, rollouts

from spotrl_runtime.core.cut_estimate import CutEstimate, barrier_form
from spotrl_runtime.core.cut_format import (
    DELTA_FILES,
    OWNER_FILES,
    CutDocuments,
    DeltaNotCoveredError,
    Manifest,
    ManifestFile,
    decode_delta_files,
    decode_owner_files,
    encode_delta_files,
    encode_owner_files,
    redo_steps,
)
from spotrl_runtime.core.fields import RecordFormatError
from spotrl_runtime.core.owners import Owners, RecoveryConfig
from spotrl_runtime.core.redo import DeltaBase, RedoLog, RedoStep, StepFingerprint

CONFIG = RecoveryConfig(group_size=2, prompts_per_step=3, lookahead=1)


def fp(step: int, where: str = "cpu/1") -> StepFingerprint:
    return StepFingerprint(loss=0.5 + step, grad_norm=1.25, params=f"{step:032x}", where=where)


def train(owners: Owners, steps: int, *, fingerprint: bool = True) -> None:
    for _ in range(steps):
        sent = owners.pump()
        for d in sent:
            owners.finish_group(d.group_id, rollouts(d))
        while not owners.step_ready():
            for d in owners.pump():
                owners.finish_group(d.group_id, rollouts(d))
        owners.begin_step()
        step = owners.trainer_step
        owners.commit_step(fingerprint=fp(step) if fingerprint else None)


def test_the_owners_keep_each_trained_step_until_a_full_cut_holds_it() -> None:
    owners = new_owners(CONFIG)
    train(owners, 3)
    steps = owners.redo_steps()
    assert [s.step for s in steps] == [0, 1, 2]
    trained = owners.capture().audit_tail
    assert [s.group_ids for s in steps] == [r.group_ids for r in trained], "in the order trained"
    assert all(len(e.group.rollouts) == 2 for s in steps for e in s.entries)
    assert owners.trim_redo(2) == 2
    assert [s.step for s in owners.capture().redo] == [2]
    train(owners, 1, fingerprint=False)
    assert owners.redo_steps() == (), "a step without a fingerprint: no delta can cover it"
    train(owners, 1)
    assert [s.step for s in owners.redo_steps()] == [4]


def test_a_redo_log_takes_steps_in_order_only() -> None:
    log = RedoLog([RedoStep(3, (), fp(3))])
    with pytest.raises(ValueError, match="does not follow step 3"):
        log.append(RedoStep(5, (), fp(5)))
    log.append(RedoStep(4, (), fp(4)))
    assert [s.step for s in log.steps()] == [3, 4]


def test_the_delta_files_round_trip_and_refuse_a_gap() -> None:
    owners = new_owners(CONFIG)
    train(owners, 4)
    snap = owners.capture()
    base = DeltaBase("0000000001", "a" * 64, 1)
    blobs = encode_delta_files(snap, base)
    assert set(blobs) == set(DELTA_FILES)
    docs = decode_delta_files(decode_owner_files(encode_owner_files(snap)), blobs)
    assert [s.step for s in docs.redo_index] == [1, 2, 3]
    prompts = {e.group_id: e.group.prompt for s in snap.redo for e in s.entries}
    assert redo_steps(docs, prompts) == snap.redo[1:], "rows, locators and fingerprints bit for bit"
    owners.trim_redo(3)
    with pytest.raises(DeltaNotCoveredError, match=r"holds steps 3\.\.3, a delta on cut 0000000001 needs 1\.\.3"):
        encode_delta_files(owners.capture(), base)


def test_a_malformed_redo_file_names_its_role() -> None:
    owners = new_owners(CONFIG)
    train(owners, 1)
    snap = owners.capture()
    docs = decode_owner_files(encode_owner_files(snap))
    good = encode_delta_files(snap, DeltaBase("0000000001", "a" * 64, 0))
    bad_fingerprint = json.loads(good["redo_index"])
    bad_fingerprint["steps"][0]["fingerprint"]["loss"] = float("nan")
    for role, blob, message in [
        ("redo_index", b"{", "is not JSON"),
        ("redo_index", json.dumps(bad_fingerprint).encode(), "loss must be a finite number"),
        ("redo_rows", good["redo_rows"][:-3], "truncated"),
    ]:
        with pytest.raises(Exception, match=message) as info:
            decode_delta_files(docs, {**good, role: blob})
        assert getattr(info.value, "role", None) == role


def test_fingerprints_match_bit_for_bit_in_one_cpu_process_else_within_a_tolerance() -> None:
    recorded = fp(3)
    assert recorded.mismatch(fp(3)) is None
    nudged = StepFingerprint(recorded.loss * (1 + 1e-9), recorded.grad_norm, recorded.params, "cpu/1")
    assert "loss" in (recorded.mismatch(nudged) or "")
    assert "params" in (recorded.mismatch(StepFingerprint(0.5 + 3, 1.25, "f" * 32, "cpu/1")) or "")
    on_gpu = StepFingerprint(recorded.loss * (1 + 1e-5), recorded.grad_norm, "f" * 32, "cuda/1")
    assert recorded.mismatch(on_gpu) is None, "elsewhere: loss and grad norm within the tolerance"
    off = StepFingerprint(recorded.loss * 1.01, recorded.grad_norm, "f" * 32, "cuda/1")
    assert "more than 0.001 apart" in (recorded.mismatch(off) or "")


def _manifest(**change: object) -> dict[str, object]:
    roles = {**OWNER_FILES, **DELTA_FILES}
    files = tuple(ManifestFile(f"w/{name}", role, 10, "0" * 64) for role, name in roles.items())
    m = Manifest(
        schema_version=2,
        cut_id="0000000002",
        kind="barrier",
        job="ns/job",
        attempt=1,
        writer="w",
        data_dir="w",
        created_at="2026-01-01T00:00:00Z",
        trainer_step=6,
        dispatch_index=6,
        group_counts={},
        dataset={},
        config={},
        files=files,
        form="delta",
        base=DeltaBase("0000000001", "b" * 64, 4),
    )
    assert Manifest.from_json(json.loads(m.to_bytes())) == m
    return {**m.to_json(), **change}


def test_a_step_redone_under_another_layout_of_updates_is_refused_by_it() -> None:
    """training.miniBatches and epochs are in the record: a redo under others says so, whatever
    the numbers; a record written before mini-batches has none, and one update a step matches it."""
    recorded = StepFingerprint(0.5, 1.25, "a" * 32, "cpu/1", "miniBatches=4,epochs=1")
    problem = recorded.mismatch(StepFingerprint(0.5, 1.25, "a" * 32, "cpu/1"))
    assert problem is not None
    assert "miniBatches=4,epochs=1" in problem
    assert "training.miniBatches, epochs or packing changed since" in problem
    assert recorded.mismatch(StepFingerprint.from_json(recorded.to_json())) is None
    old = {"loss": 0.5, "grad_norm": 1.25, "params": "a" * 32, "where": "cpu/1"}
    assert StepFingerprint.from_json(old).layout == ""
    assert StepFingerprint(0.5, 1.25, "a" * 32, "cpu/1").to_json() == old, "one update a step writes what it did"
    assert StepFingerprint.from_json(old).mismatch(StepFingerprint(0.5, 1.25, "a" * 32, "cpu/1")) is None
    packed = StepFingerprint(0.5, 1.25, "a" * 32, "cpu/1", "miniBatches=2,epochs=1,packed")
    problem = packed.mismatch(StepFingerprint(0.5, 1.25, "a" * 32, "cpu/1", "packed"))
    assert problem is not None
    assert "trained with miniBatches=2,epochs=1, packed and is redone with one update, packed" in problem


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"form": "half"}, "form must be one of"),
        ({"base": None}, "base must be a JSON object"),
        ({"base": {"cut_id": "1", "manifest_sha256": "xyz", "trainer_step": 4}}, "64 lowercase hex"),
        ({"trainer_format": "torch.save/v2"}, "holds no trainer state"),
        ({"form": "full"}, "a full cut has no base"),
    ],
)
def test_a_manifest_says_what_it_holds_and_nothing_else(change: dict[str, object], message: str) -> None:
    with pytest.raises(RecordFormatError, match=message):
        Manifest.from_json(_manifest(**change))


def test_a_delta_manifest_lists_its_redo_files() -> None:
    data = _manifest()
    files = [f for f in data["files"] if f["role"] != "redo_rows"]  # type: ignore[attr-defined]
    with pytest.raises(RecordFormatError, match=r"lacks the delta cut's files \['redo_rows'\]"):
        Manifest.from_json({**data, "files": files})
    old = {k: v for k, v in _manifest(form="full", base=None).items() if k not in ("form", "base")}
    assert Manifest.from_json(old).form == "full", "a manifest written before deltas is a full cut"


EST = CutEstimate(seconds=20.0, bytes=10**9, bytes_per_second=5e7, overhead_seconds=0.5, based_on_cuts=3)


@pytest.mark.parametrize(
    ("mode", "est", "remaining", "why_not", "want"),
    [
        ("auto", EST, 100.0, None, "full"),  # 20 s fits 80% of 100 s
        ("auto", EST, 24.0, None, "delta"),  # 20 s > 80% of 24 s
        ("auto", None, 100.0, None, "delta"),  # nothing measured: the small one
        ("auto", EST, 24.0, "no full cut to extend yet", "full"),
        ("delta", EST, 1000.0, None, "delta"),
        ("delta", EST, 10.0, "the redo log does not hold every step since full cut 3", "full"),
        ("full", EST, 10.0, None, "full"),
    ],
)
def test_the_barrier_cuts_a_delta_when_a_full_cut_would_not_fit(
    mode: str, est: CutEstimate | None, remaining: float, why_not: str | None, want: str
) -> None:
    form, why = barrier_form(mode, est, remaining, delta_possible=why_not)
    assert form == want, why
    if why_not is not None and mode != "full":
        assert why_not in why


def test_decoded_documents_of_a_full_cut_have_no_redo() -> None:
    owners = new_owners(CONFIG)
    train(owners, 2)
    docs: CutDocuments = decode_owner_files(encode_owner_files(owners.capture()))
    assert docs.redo_index == ()
    assert docs.redo_rollouts == {}


def test_a_redo_log_longer_than_the_audit_tail_is_dropped_not_kept_growing() -> None:
    owners = new_owners(RecoveryConfig(group_size=2, prompts_per_step=3, lookahead=1, audit_tail=2))
    train(owners, 2)
    assert [s.step for s in owners.redo_steps()] == [0, 1]
    train(owners, 1)
    assert [s.step for s in owners.redo_steps()] == [2], "a delta past the audit tail could never be cut"
