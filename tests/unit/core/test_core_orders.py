"""The retired-orders set: the same members as a plain set, kept as canonical intervals."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spotrl_runtime.core.orders import OrderSet


@given(st.lists(st.integers(0, 60), max_size=80))
def test_adds_in_any_order_keep_the_members_of_a_set_as_separated_intervals(orders: list[int]) -> None:
    s, plain = OrderSet(), set()
    for o in orders:
        assert s.add(o) == (o not in plain)
        plain.add(o)
    assert len(s) == len(plain)
    assert all((o in s) == (o in plain) for o in range(-1, 62))
    pairs = s.intervals()
    assert all(a < b for a, b in pairs)
    assert all(pairs[i][1] < pairs[i + 1][0] for i in range(len(pairs) - 1)), "touching intervals are merged"
    assert OrderSet.from_json(s.to_json()).intervals() == pairs


@pytest.mark.parametrize(
    "data",
    [None, "x", [[1]], [[3, 3]], [[-1, 2]], [[0, 2], [1, 4]], [[0, 2], [2, 4]], [[5, 6], [0, 1]], [[0, 1.5]]],
)
def test_a_malformed_set_is_refused(data: object) -> None:
    with pytest.raises(ValueError, match=r"pairs|interval"):
        OrderSet.from_json(data)
