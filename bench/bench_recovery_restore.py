"""Validate and rehydrate a cut with 10,000 groups (5,000 in flight, 5,000 finished with rows).

    PYTHONPATH=e2e python bench/bench_recovery_restore.py

"validate" runs the whole chain (digests, decoding, ledger and owner checks, the checks
between owners, and every prompt rebuilt from dataset[idx] at the row its order reads);
"between owners" is the part of it that the cross-owner checks (one_config .. loader_rows)
cost, measured alone on the decoded cut; "restore" adds rebuilding the owners and the loader.
Local folder and S3 (versitygw on loopback, started here).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from _recovery_state import BATCH, GROUPS, busy_owners, table, timed
from spotrl_runtime.checkpoint import CutRequest, CutWriter, DatasetLookup, restore_cut, validate_stored_cut
from spotrl_runtime.core import validation as v
from spotrl_runtime.core.validation import ValidatedCut
from spotrl_runtime.data import PromptCollate
from spotrl_runtime.data.loader import PromptLoader
from spotrl_runtime.storage import LocalStorage, Storage
from spotrl_runtime.storage.s3 import S3Storage


def measure(label: str, storage: Storage) -> tuple[str, ...]:
    owners, dataset, _ = busy_owners(GROUPS // 2)
    described = {"uri": dataset.uri, "size": len(dataset), "shuffle": True, "seed": 1}
    cut = CutWriter(storage, job="bench", dataset=described).write(owners, CutRequest.periodic())
    lookup = DatasetLookup(dataset, PromptCollate())
    validate_s, validated = timed(lambda: validate_stored_cut(storage, cut.cut_id, lookup), repeat=3)
    assert len(validated.prompts) == GROUPS + BATCH  # and one RESERVED batch at the gate
    between_s, _ = timed(lambda: between_owners(validated, lookup), repeat=3)

    def restore() -> object:
        loader = PromptLoader(dataset, PromptCollate(), batch_size=BATCH, shuffle=True, seed=1)
        return restore_cut(storage, dataset=dataset, collate=PromptCollate(), source=loader, load_trainer=False)

    restore_s, restored = timed(restore, repeat=3)
    assert restored.owners.counters.groups_found == GROUPS // 2 + BATCH  # type: ignore[attr-defined]
    return (
        label,
        f"{cut.bytes_written / 1e6:.1f} MB",
        f"{validate_s * 1e3:.0f} ms",
        f"{between_s * 1e3:.0f} ms",
        f"{restore_s * 1e3:.0f} ms",
        f"{restore_s / GROUPS * 1e6:.0f} µs",
    )


def between_owners(validated: ValidatedCut, lookup: DatasetLookup) -> None:
    """The checks between owners, on a cut already decoded (no I/O)."""
    m, docs, loc = validated.manifest, validated.documents, "bench"
    v.check_one_config(loc, m, docs)
    v.check_counters(loc, m, docs)
    v.check_gate(loc, m, docs)
    v.check_coverage(loc, m, docs)
    v.check_census(loc, m, docs)
    v.check_fingerprints_uniform(loc, m, docs)
    v.check_loader_position(loc, m, docs, v.Expectations())
    v.check_loader_rows(loc, m, docs, lookup)


def main() -> None:
    from spotrl_e2e.s3 import S3Server

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows.append(measure("local folder", LocalStorage(Path(tmp) / "job")))
        server = S3Server(Path(tmp) / "s3").start()
        try:
            bucket = server.create_bucket("bench")
            s3 = S3Storage(
                bucket.bucket,
                "job",
                endpoint_url=bucket.endpoint,
                region=bucket.region,
                access_key=bucket.access_key,
                secret_key=bucket.secret_key,
            )
            rows.append(measure("S3 (versitygw, loopback)", s3))
        finally:
            server.stop()
    table(
        f"Validate and rehydrate a cut with {GROUPS:,} groups",
        (
            "store",
            "cut size",
            "validate (whole chain)",
            "of it: between owners",
            "restore (validate + rebuild owners)",
            "per group",
        ),
        rows,
    )


if __name__ == "__main__":
    main()
