"""Validate and rehydrate a cut with 10,000 groups (5,000 in flight, 5,000 finished with rows).

    PYTHONPATH=e2e python bench/bench_recovery_restore.py

"validate" runs the whole chain (digests, decoding, ledger and owner checks, and every
prompt rebuilt from dataset[idx]); "restore" adds rebuilding the owners and the loader.
Local folder and S3 (versitygw on loopback, started here).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from _recovery_state import BATCH, GROUPS, busy_owners, table, timed
from spotrl_runtime.checkpoint import CutRequest, CutWriter, DatasetLookup, restore_cut, validate_stored_cut
from spotrl_runtime.data import PromptCollate
from spotrl_runtime.data.loader import PromptLoader
from spotrl_runtime.storage import LocalStorage, Storage
from spotrl_runtime.storage.s3 import S3Storage


def measure(label: str, storage: Storage) -> tuple[str, ...]:
    owners, dataset, _ = busy_owners(GROUPS // 2)
    cut = CutWriter(storage, job="bench", dataset={"uri": dataset.uri, "size": len(dataset)}).write(
        owners, CutRequest.periodic()
    )
    lookup = DatasetLookup(dataset, PromptCollate())
    validate_s, validated = timed(lambda: validate_stored_cut(storage, cut.cut_id, lookup), repeat=3)
    assert len(validated.prompts) == GROUPS + BATCH  # and one RESERVED batch at the gate

    def restore() -> object:
        loader = PromptLoader(dataset, PromptCollate(), batch_size=BATCH, shuffle=True, seed=1)
        return restore_cut(storage, dataset=dataset, collate=PromptCollate(), source=loader, load_trainer=False)

    restore_s, restored = timed(restore, repeat=3)
    assert restored.owners.counters.groups_found == GROUPS // 2 + BATCH  # type: ignore[attr-defined]
    return (
        label,
        f"{cut.bytes_written / 1e6:.1f} MB",
        f"{validate_s * 1e3:.0f} ms",
        f"{restore_s * 1e3:.0f} ms",
        f"{restore_s / GROUPS * 1e6:.0f} µs",
    )


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
        ("store", "cut size", "validate (whole chain)", "restore (validate + rebuild owners)", "per group"),
        rows,
    )


if __name__ == "__main__":
    main()
