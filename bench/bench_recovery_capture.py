"""Capture and serialise the ledger and the replay index with 10,000 groups in flight.

    python bench/bench_recovery_capture.py

Capture is the part of a cut that holds the ownership lock (an in-memory copy of every
owner); serialising the owner files happens after the lock is released.
"""

from __future__ import annotations

import json

from _recovery_state import GROUPS, busy_owners, table, timed
from spotrl_runtime.core.cut_format import encode_owner_files


def main() -> None:
    rows = []
    for label, finished in (("10,000 in the ledger (ADMITTED)", 0), ("10,000 finished (replay buffer)", GROUPS)):
        owners, _, _ = busy_owners(finished)
        capture_s, snap = timed(owners.capture)
        encode_s, files = timed(lambda snap=snap: encode_owner_files(snap))
        ledger = len(files["ledger"])
        replay = len(files["replay_index"])
        locators = ledger if finished == 0 else replay
        rows.append(
            (
                label,
                f"{capture_s * 1e3:.1f} ms",
                f"{encode_s * 1e3:.1f} ms",
                f"{locators / GROUPS:.0f} B",
                f"{len(files['rollouts']) / GROUPS:.0f} B" if finished else "-",
                f"{sum(map(len, files.values())) / 1e6:.2f} MB",
            )
        )
        assert json.loads(files["ledger"])["records"] or finished
    table(
        f"Capture and serialise {GROUPS:,} groups",
        (
            "owners",
            "capture (lock held)",
            "serialise owner files",
            "locator bytes/group",
            "rollout rows bytes/group",
            "owner files total",
        ),
        rows,
    )
    print("\nlocator bytes/group: ledger.json per ledger group, replay_index.json per finished group.")
    print("rollout rows: G=4 rollouts of ~8 prompt + 32 completion tokens, int32 ids, float64 log-probs.")


if __name__ == "__main__":
    main()
