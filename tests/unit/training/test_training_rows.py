"""How a step's rows are shared among trainer ranks (pure), and the group's fit check."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from training_helpers import make_group

from spotrl_runtime.training.group import TrainerGroup, TrainerGroupError
from spotrl_runtime.training.rows import (
    LossSums,
    Row,
    micro_batches,
    plan_micro_batches,
    split_rows,
    step_metrics,
    step_rows,
)


def groups(n: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    return [make_group(f"g{i}", [rng.choice([0.0, 1.0]) for _ in range(4)], seed=seed) for i in range(n)]


@pytest.mark.parametrize("ranks", [1, 2, 3, 5])
@pytest.mark.parametrize("seed", range(4))
def test_every_row_goes_to_exactly_one_rank_with_its_whole_group(ranks: int, seed: int) -> None:
    plan = step_rows(groups(11, seed))
    shares = split_rows(plan, ranks)
    assert len(shares) == ranks
    assert Counter(id(r) for s in shares for r in s) == Counter(id(r) for r in plan.rows)
    for group in plan.by_group:
        holders = {k for k, s in enumerate(shares) if any(r is group[0] for r in s)}
        assert len(holders) == 1
        (k,) = holders
        assert all(any(r is x for x in shares[k]) for r in group), "a group's rows stay on one rank"


def test_shares_are_balanced_by_tokens_and_deterministic() -> None:
    plan = step_rows(groups(40, seed=7))
    shares = split_rows(plan, 4)
    load = [sum(len(r.completion_ids) for r in s) for s in shares]
    biggest_group = max(sum(len(r.completion_ids) for r in g) for g in plan.by_group)
    assert max(load) - min(load) <= biggest_group, load
    assert split_rows(plan, 4) == shares
    assert sum(load) == plan.tokens


def test_more_ranks_than_groups_leaves_some_empty_and_micro_batches_follow_the_largest_share() -> None:
    plan = step_rows([make_group("a", [0.0, 1.0, 1.0, 0.0]), make_group("b", [1.0, 0.0, 0.0, 0.0])])
    shares = split_rows(plan, 3)
    assert sorted(len(s) for s in shares) == [0, 4, 4]
    assert micro_batches(shares, 3, None) == 2
    assert micro_batches([[], []], 3, None) == 0
    with pytest.raises(ValueError, match="ranks must be at least 1"):
        split_rows(plan, 0)


def test_zero_variance_groups_are_counted_not_trained() -> None:
    plan = step_rows([make_group("same", [1.0, 1.0, 1.0]), make_group("diff", [0.0, 1.0, 0.0])])
    assert (plan.groups, plan.skipped, len(plan.by_group), len(plan.rows)) == (2, 1, 1, 3)


def test_ranks_loss_sums_add_up_to_the_step_metrics() -> None:
    plan = step_rows(groups(6))
    a = LossSums(loss=3.0, policy=2.0, kl=0.5, clipped=2, ratio=10.0, ratio_max=1.3)
    b = LossSums(loss=1.0, policy=1.0, kl=0.25, clipped=1, ratio=5.0, ratio_max=1.1)
    m = step_metrics(plan, LossSums.total([a, b]))
    assert m["loss"] == pytest.approx(4.0 / plan.tokens)
    assert m["kl"] == pytest.approx(0.75 / plan.tokens)
    assert m["clip_fraction"] == pytest.approx(3 / plan.tokens)
    assert m["ratio_max"] == 1.3
    assert m["groups"] == 6.0


def _group(ranks: int, cpus: float, workers: int, pods: bool = False) -> TrainerGroup:
    return TrainerGroup(
        "builtin:tiny-arith", None, ranks=ranks, cpus_per_rank=cpus, trainer_pods=pods, local_workers=workers
    )  # type: ignore[arg-type]


def test_ranks_in_the_controller_must_fit_beside_its_generation_workers() -> None:
    _group(3, 1 / 3, workers=1)._check_fits({"CPU": 2.0})
    with pytest.raises(TrainerGroupError, match=r"3 ranks, beside 1 generation worker.*CPU 2\.5 \(this Ray has 2\)"):
        _group(3, 0.5, workers=1)._check_fits({"CPU": 2.0})
    with pytest.raises(TrainerGroupError, match="cpusPerRank or ranks, or run the ranks in trainer pods"):
        _group(2, 1.0, workers=0)._check_fits({"CPU": 1.0})
    gpu = TrainerGroup("m", None, ranks=2, gpus_per_rank=1)  # type: ignore[arg-type]
    with pytest.raises(TrainerGroupError, match=r"GPU 2 \(this Ray has 1\)"):
        gpu._check_fits({"CPU": 8.0, "GPU": 1.0})


def test_micro_batches_by_a_token_budget_put_rows_of_like_length_together() -> None:
    """Longest rows first, each batch within the row cap and, padded to its longest, the token
    budget; a row longer than the budget goes alone; nothing is lost or repeated."""
    rows = [Row((1,) * p, (5,) * c, (-1.0,) * c, 1.0) for p, c in [(2, 3), (9, 30), (2, 1), (9, 28), (4, 4), (2, 90)]]
    batches = plan_micro_batches(rows, 8, 80)
    assert [[len(r.prompt_ids) + len(r.completion_ids) for r in b] for b in batches] == [[92], [39, 37], [8, 5, 3]]
    assert sorted(map(id, (r for b in batches for r in b))) == sorted(map(id, rows))
    widths = [max(len(r.prompt_ids) + len(r.completion_ids) for r in b) for b in batches]
    assert all(len(b) == 1 or w * len(b) <= 80 for b, w in zip(batches, widths, strict=True))
    assert [len(b) for b in plan_micro_batches(rows, 2, None)] == [2, 2, 2]
    assert micro_batches([rows, rows[:2]], 8, 80) == 3
