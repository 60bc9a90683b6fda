"""How a policy's weights are split into the parts of a ``torch.save/v2`` cut (pure)."""

from __future__ import annotations

import torch

from spotrl_runtime.checkpoint.trainer_state import weight_parts
from spotrl_runtime.core.cut_format import weight_part_index, weight_part_name

MiB = 1 << 20


def mib(n: float) -> torch.Tensor:
    return torch.zeros(int(n * MiB) // 4)


def test_a_small_policy_is_one_part() -> None:
    sd = {"a": mib(1), "b": mib(2)}
    assert weight_parts(sd, part_bytes=128 * MiB) == [sd]
    assert list(weight_parts(sd, part_bytes=128 * MiB)[0]) == ["a", "b"]


def test_parts_are_balanced_keep_key_order_and_lose_nothing() -> None:
    sd = {f"layer{i}": mib(s) for i, s in enumerate([8, 1, 7, 2, 6, 3, 5, 4])}
    parts = weight_parts(sd, part_bytes=12 * MiB)
    assert len(parts) == 3  # 36 MiB at 12 MiB a part
    sizes = [sum(t.nbytes for t in p.values()) / MiB for p in parts]
    assert max(sizes) <= 36 / 3 * 4 / 3, sizes  # largest first: within 4/3 of the best split
    assert min(sizes) >= 36 / 3 * 2 / 3, sizes
    assert sorted(k for p in parts for k in p) == sorted(sd)
    order = list(sd)
    for p in parts:
        assert list(p) == sorted(p, key=order.index)
    assert weight_parts(dict(sd), part_bytes=12 * MiB) == parts, "the same keys and sizes split the same way"


def test_tied_weights_stay_in_one_part_and_count_once() -> None:
    shared = mib(8)
    sd = {"embed": shared, "x": mib(4), "y": mib(4), "lm_head": shared, "z": mib(0.5)}
    parts = weight_parts(sd, part_bytes=8 * MiB)
    holder = next(p for p in parts if "embed" in p)
    assert "lm_head" in holder
    assert holder["lm_head"] is shared
    assert len(parts) == 3, [list(p) for p in parts]  # 16.5 MiB stored (the tie once), not 24.5


def test_at_most_max_parts_and_no_empty_part() -> None:
    sd = {f"w{i}": mib(1) for i in range(20)}
    assert len(weight_parts(sd, part_bytes=MiB // 2, max_parts=8)) == 8
    few = {"big": mib(10), "tiny": torch.zeros(0), "step": 3}
    parts = weight_parts(few, part_bytes=MiB)
    assert all(parts)
    assert sorted(k for p in parts for k in p) == ["big", "step", "tiny"]


def test_part_names_round_trip_and_nothing_else_parses() -> None:
    assert weight_part_name(2, 4) == "trainer/weights-00002-of-00004.pt"
    assert weight_part_index(weight_part_name(2, 4)) == (2, 4)
    for other in (
        "trainer/weights.pt",
        "trainer/weights-2-of-4.pt",
        "weights-00002-of-00004.pt",
        "trainer/weights-00002-of-00004.pt.bak",
    ):
        assert weight_part_index(other) is None, other
