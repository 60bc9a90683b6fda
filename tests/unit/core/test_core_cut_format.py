"""Schema v1 of a cut: owner files round-trip exactly, the ledger stays small, the manifest is strict."""

from __future__ import annotations

import json
import struct

import pytest
from scripted_generation import new_owners, rollout, rollouts

from spotrl_runtime.core.audit import AuditRecord, effective_stream
from spotrl_runtime.core.cut_format import (
    OWNER_FILES,
    Manifest,
    ManifestFile,
    OwnerFileError,
    decode_owner_files,
    decode_rollouts,
    document_counts,
    encode_owner_files,
    encode_rollouts,
    snapshot_counts,
    to_snapshot,
)
from spotrl_runtime.core.fields import RecordFormatError
from spotrl_runtime.core.ledger import LedgerRecord
from spotrl_runtime.core.owners import OwnersSnapshot, RecoveryConfig
from spotrl_runtime.core.types import Rollout


def busy_snapshot() -> OwnersSnapshot:
    config = RecoveryConfig(
        group_size=3, prompts_per_step=4, lookahead=2, on_dropped_prompt="replace", spare_pool_batches=1
    )
    owners = new_owners(config, size=50, shuffle=True, seed=5)
    sent = {d.group_id: d for d in owners.pump()}
    for gid in ("g0", "g1", "g2", "g3"):
        owners.finish_group(gid, rollouts(sent[gid]))
    owners.begin_step()
    owners.commit_step()
    sent.update({d.group_id: d for d in owners.pump()})
    owners.finish_group("g8", rollouts(sent["g8"]))
    owners.add_rollout("g9", rollout(sent["g9"], 1))
    owners.drop_group("g10", "failed")
    return owners.capture()


def test_owner_files_round_trip_exactly() -> None:
    snap = busy_snapshot()
    blobs = encode_owner_files(snap)
    assert set(blobs) == set(OWNER_FILES)
    docs = decode_owner_files(blobs)
    docs = type(docs)(**{**docs.__dict__, "ledger": tuple(LedgerRecord.from_json(r) for r in docs.ledger_raw)})
    assert document_counts(docs) == snapshot_counts(snap)
    back = to_snapshot(docs, snap.prompts | {e.group_id: e.group.prompt for e in snap.replay})
    for field in (
        "config",
        "attempt",
        "trainer_step",
        "dispatch_index",
        "next_order",
        "next_admission",
        "ledger",
        "spares",
        "replay",
        "shortfall",
        "dropped",
        "audit_tail",
    ):
        assert getattr(back, field) == getattr(snap, field), field
    assert dict(back.partial) == dict(snap.partial)
    assert back.loader_state == json.loads(json.dumps(snap.loader_state))


def test_rollout_rows_are_bit_exact() -> None:
    rows = (
        Rollout("g1", 0, (1, 2, 2**31 - 1), (5,), (-1e-300, 0.1 + 0.2), 0.333333333333, 3, "ünïcode", "length"),
        Rollout("g1", 1, (), (), (), -1.5, 3, "", ""),
    )
    assert decode_rollouts(encode_rollouts([("g1", rows)])) == {"g1": rows}
    blob = encode_rollouts([("g1", rows)])
    with pytest.raises(OwnerFileError, match="truncated"):
        decode_rollouts(blob[:-3])
    with pytest.raises(OwnerFileError, match="SPOTRLR1"):
        decode_rollouts(b"garbage")


def test_an_episodes_observation_spans_round_trip_and_single_turn_rows_keep_nine_columns() -> None:
    episode = Rollout("g1", 0, (1, 2), (5, 6, 7, 8, 9), (-0.5, 0.0, 0.0, -0.25, -1.0), 1.0, 2, observed=((1, 3),))
    plain = Rollout("g1", 1, (1, 2), (5, 6), (-0.5, -0.5), 0.0, 2)
    blob = encode_rollouts([("g1", (episode, plain))])
    assert decode_rollouts(blob) == {"g1": (episode, plain)}
    table = _row_table(blob)
    assert [len(row) for row in table] == [10, 9], "a row without observations is readable by an older controller"


@pytest.mark.parametrize("spans", [[[3, 2]], [[0, 2], [1, 4]], [[4, 6]], [[2, 2]], [[1, True]], [], "x"])
def test_forged_observation_spans_are_refused(spans: object) -> None:
    """A row table consistent in everything but its spans: the file is refused, not half-read."""
    good = encode_rollouts([("g1", (Rollout("g1", 0, (1,), (5, 6, 7, 8, 9), (0.0,) * 5, 1.0, 2, observed=((1, 3),)),))])
    table = _row_table(good)
    table[0][9] = spans
    with pytest.raises(OwnerFileError, match="optional observation spans"):
        decode_rollouts(_with_table(good, table))


def _row_table(blob: bytes) -> list[list[object]]:
    (length,) = struct.unpack_from("<Q", blob, 8)
    return list(json.loads(blob[16 : 16 + length])["rows"])


def _with_table(blob: bytes, table: list[list[object]]) -> bytes:
    (length,) = struct.unpack_from("<Q", blob, 8)
    header = json.dumps({"rows": table}).encode()
    return blob[:8] + struct.pack("<Q", len(header)) + header + blob[16 + length :]


def test_ledger_records_are_locators_of_a_few_hundred_bytes_whatever_the_prompt() -> None:
    snap = busy_snapshot()
    ledger = json.loads(encode_owner_files(snap)["ledger"])["records"]
    assert ledger
    for rec in ledger:
        assert len(json.dumps(rec)) < 400
        assert set(rec) == {
            "group_id",
            "admission_id",
            "order",
            "idx",
            "task_name",
            "phase",
            "target_step",
            "expected_generations",
            "weight_version",
            "fingerprint",
        }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"phase": "DONE"}, "phase is 'DONE'"),
        ({"group_id": ""}, "group_id must be a non-empty string"),
        ({"target_step": -1}, "target_step must be an integer >= 0"),
        ({"idx": True}, "idx must be an integer"),
        ({"expected_generations": 0}, "expected_generations must be an integer >= 1"),
    ],
)
def test_ledger_record_parsing_names_the_field(change: dict[str, object], message: str) -> None:
    good = {
        "group_id": "g1",
        "admission_id": "a0",
        "order": 1,
        "idx": 4,
        "task_name": "add",
        "phase": "ADMITTED",
        "target_step": 2,
        "expected_generations": 4,
        "weight_version": 1,
        "fingerprint": "",
    }
    assert LedgerRecord.from_json(good).target_step == 2
    with pytest.raises(RecordFormatError, match=message):
        LedgerRecord.from_json({**good, **change})


def test_manifest_round_trip_and_strictness() -> None:
    files = tuple(ManifestFile(f"w/{name}", role, 10, "0" * 64) for role, name in OWNER_FILES.items())
    manifest = Manifest(
        schema_version=1,
        cut_id="0000000001",
        kind="barrier",
        job="ns/job",
        attempt=2,
        writer="w",
        data_dir="w",
        created_at="2026-01-01T00:00:00Z",
        trainer_step=3,
        dispatch_index=4,
        group_counts={"reserved": 1},
        dataset={"uri": "builtin:arithmetic", "size": 10},
        config={"group_size": 2},
        files=files,
    )
    assert Manifest.from_json(json.loads(manifest.to_bytes())) == manifest
    data = manifest.to_json()
    with pytest.raises(RecordFormatError, match="lacks the owner files"):
        Manifest.from_json({**data, "files": data["files"][1:]})
    with pytest.raises(RecordFormatError, match="kind must be one of"):
        Manifest.from_json({**data, "kind": "sometimes"})
    with pytest.raises(RecordFormatError, match="must be relative"):
        Manifest.from_json({**data, "files": [*data["files"], {**data["files"][0], "path": "../x"}]})


def test_effective_stream_keeps_the_last_attempt_per_step() -> None:
    def rec(step: int, attempt: int, idxs: tuple[int, ...]) -> AuditRecord:
        return AuditRecord(step, attempt, step + 1, tuple(f"g{i}" for i in idxs), idxs, ("add",) * len(idxs))

    records = [rec(0, 0, (1,)), rec(1, 0, (2,)), rec(2, 0, (3,)), rec(1, 1, (2,)), rec(2, 1, (4,)), rec(3, 1, (5,))]
    stream = effective_stream(records)
    assert {s: (r.attempt, r.idxs) for s, r in stream.items()} == {
        0: (0, (1,)),
        1: (1, (2,)),
        2: (1, (4,)),
        3: (1, (5,)),
    }
    assert AuditRecord.from_json(json.loads(json.dumps(records[0].to_json()))) == records[0]
