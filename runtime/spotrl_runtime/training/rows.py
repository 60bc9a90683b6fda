"""A step's work as rows, and how it is shared among trainer ranks. Pure: no torch, no I/O.

A step trains on the finished groups stamped for it. Each rollout of a group whose rewards
differ becomes a :class:`Row` (prompt, completion, generation-time log-probs, the group-relative
advantage, and its tokens' weight in the step's loss aggregation). The loss of the step is a
weighted token mean over every row, its weights fixed by the whole step, so a row's gradient
does not depend on which process computes it: a group of ranks splits the rows (whole groups,
balanced by tokens, :func:`split_rows`), each rank divides its micro-batch sums by the *step's*
token count, and the ranks' gradients add up to the single process's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from spotrl_runtime.core.types import FinishedGroup, Rollout, check_observed, generated_offsets
from spotrl_runtime.generation.types import FINISH_LENGTH
from spotrl_runtime.training.advantages import (
    DEFAULT_OBJECTIVE,
    Objective,
    contributes,
    group_advantages,
    overlong_penalty,
    row_scales,
    whiten,
)


@dataclass(frozen=True)
class Row:
    """One rollout as the trainer sees it."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    old_logprobs: tuple[float, ...]
    advantage: float
    weight_version: int = -1
    """The policy version that generated the completion (-1: a padding row)."""
    scale: float = 1.0
    """Each of its tokens' weight in the step's loss against a token of ``token-mean``
    (:func:`~spotrl_runtime.training.advantages.row_scales`)."""
    proximal: tuple[float, ...] | None = None
    """The trainer's log-probs of its completion before the step's first update, when the step
    makes more than one (``training.miniBatches``, ``epochs``) or scores its rollouts first
    (``training.kl.inReward``); None: the pass's own, detached."""
    observed: tuple[tuple[int, int], ...] = ()
    """Spans ``[start, end)`` of the completion the policy did not generate: an episode's
    observations (a tool's output, an environment's reply, with the chat template's tokens
    around them). They are context for the tokens after them and are never trained:
    ``old_logprobs``, ``proximal`` and every count of trained tokens leave them out."""

    @property
    def trained(self) -> int:
        """Its trained tokens: the completion less its observations."""
        return len(self.completion_ids) - sum(end - start for start, end in self.observed)


@dataclass(frozen=True)
class Scored:
    """A rollout as the trainer scored it before the step's first update (``training.kl.inReward``)."""

    kl: float
    """The KL estimator summed over its completion (policy against reference)."""
    logprobs: tuple[float, ...]
    """The policy's log-probs of its completion: the step's proximal log-probs."""


@dataclass(frozen=True)
class StepRows:
    """A step's rows, grouped as their groups were (a group's rows stay on one rank)."""

    by_group: tuple[tuple[Row, ...], ...]
    rewards: tuple[float, ...]
    groups: int
    skipped: int
    """Groups that contribute nothing (fewer than 2 rollouts, or equal rewards)."""
    sources: tuple[int, ...] = ()
    """For each of ``by_group``, the index of its group in the step's groups."""
    overlong: dict[str, float] | None = None
    """With ``training.overlong`` set: ``overlong_filtered`` (completions cut off at the limit
    and left out of the loss) and ``overlong_penalty_mean`` (the soft penalty's mean over the
    step's rollouts); None without."""
    reward_kl: dict[str, float] | None = None
    """With ``training.kl.inReward``: ``kl`` (the estimator's mean over the step's completion
    tokens) and ``reward_kl_penalty_mean`` (what it took from the rewards, a rollout's mean);
    None without."""

    @property
    def rows(self) -> list[Row]:
        return [r for g in self.by_group for r in g]

    @property
    def tokens(self) -> int:
        """Completion tokens of the whole step: what every rank divides its loss sums by."""
        return sum(r.trained for g in self.by_group for r in g)


def step_rows(
    groups: Sequence[FinishedGroup],
    objective: Objective = DEFAULT_OBJECTIVE,
    scored: Sequence[Sequence[Scored]] | None = None,
) -> StepRows:
    """The rows of a step: advantages per group (of the rewards with the overlong penalty and,
    with ``training.kl.inReward``, less the KL penalty of ``scored``; whitened over the step's
    tokens for ``reinforce++-baseline``), each row's loss scale; groups without variance, empty
    completions and (with the overlong filter) cut-off ones left out. ``scored``: per group, per
    rollout (:func:`scored_by_group`); its log-probs become the rows' proximal ones."""
    if objective.reward_kl and scored is None:
        raise ValueError("training.kl.inReward: the step's rollouts must be scored first (Trainer.score)")
    by_group: list[list[Row]] = []
    sources: list[int] = []
    skipped = filtered = 0
    penalty = 0.0
    for index, group in enumerate(groups):
        kl = [objective.reward_kl * s.kl for s in scored[index]] if scored is not None else [0.0] * len(group.rollouts)
        shaped = [
            r.reward + overlong_penalty(len(r.completion_token_ids), objective) - k
            for r, k in zip(group.rollouts, kl, strict=True)
        ]
        penalty += sum(shaped) - sum(r.reward for r in group.rollouts) + sum(kl)
        if len(shaped) < 2 or not contributes(shaped):
            skipped += 1
            continue
        rows = []
        for k, (rollout, adv) in enumerate(
            zip(group.rollouts, group_advantages(shaped, objective).tolist(), strict=True)
        ):
            if objective.overlong_filter and rollout.finish_reason == FINISH_LENGTH:
                filtered += 1
            elif rollout.completion_token_ids:
                proximal = scored[index][k].logprobs if scored is not None else None
                rows.append(replace(rollout_row(rollout), advantage=float(adv), proximal=proximal))
        if rows:
            by_group.append(rows)
            sources.append(index)
    rewards = tuple(r.reward for g in groups for r in g.rollouts)
    overlong = None
    if objective.overlong_filter or objective.soft_penalty is not None:
        overlong = {"overlong_filtered": float(filtered), "overlong_penalty_mean": penalty / max(len(rewards), 1)}
    if objective.estimator == "reinforce++-baseline":
        by_group = _whitened(by_group)
    scaled = _scaled(by_group, len(rewards), objective)
    reward_kl = _reward_kl(scored, objective) if scored is not None else None
    return StepRows(scaled, rewards, len(groups), skipped, tuple(sources), overlong, reward_kl)


def _reward_kl(scored: Sequence[Sequence[Scored]], objective: Objective) -> dict[str, float]:
    """``training.kl.inReward``'s step metrics (:attr:`StepRows.reward_kl`)."""
    flat = [s for g in scored for s in g]
    total = sum(s.kl for s in flat)
    tokens = sum(len(s.logprobs) for s in flat)
    return {"kl": total / max(tokens, 1), "reward_kl_penalty_mean": objective.reward_kl * total / max(len(flat), 1)}


def rollout_row(rollout: Rollout) -> Row:
    """``rollout`` as a row with no advantage yet: its generated tokens' log-probs only (an
    observation's tokens carry none of the policy's)."""
    if len(rollout.logprobs) != len(rollout.completion_token_ids):
        raise ValueError(
            f"group {rollout.group_id} rollout {rollout.index}: {len(rollout.logprobs)} logprobs for "
            f"{len(rollout.completion_token_ids)} completion tokens"
        )
    what = f"group {rollout.group_id} rollout {rollout.index}"
    observed = check_observed(rollout.observed, len(rollout.completion_token_ids), what)
    return Row(
        rollout.prompt_token_ids,
        rollout.completion_token_ids,
        generated_values(rollout.logprobs, observed),
        0.0,
        rollout.weight_version,
        observed=observed,
    )


def generated_values(values: Sequence[float], observed: Sequence[tuple[int, int]]) -> tuple[float, ...]:
    """``values`` (one per completion token) at the generated tokens alone, in order."""
    return tuple(values[k] for k in generated_offsets(len(values), observed))


def score_rows(groups: Sequence[FinishedGroup]) -> list[list[Row]]:
    """Per group, its rollouts with a completion as rows to score (:class:`Scored`; no advantage yet)."""
    return [[rollout_row(r) for r in g.rollouts if r.completion_token_ids] for g in groups]


def scored_by_group(groups: Sequence[FinishedGroup], values: Sequence[Scored]) -> list[list[Scored]]:
    """``values`` (one per row of :func:`score_rows`, in its order) per group, per rollout: an
    empty completion scores a KL of 0 and no log-probs."""
    flat = iter(values)
    out = [[next(flat) if r.completion_token_ids else Scored(0.0, ()) for r in g.rollouts] for g in groups]
    if next(flat, None) is not None:
        raise ValueError("more scores than the step's rollouts with a completion")
    return out


def step_updates(
    groups: Sequence[FinishedGroup], step: StepRows, objective: Objective, mini_batches: int
) -> list[StepRows]:
    """The step's optimizer updates (``training.miniBatches``): its groups in ``mini_batches``
    contiguous runs, in the order the step trains them (the first ``len(groups) % mini_batches``
    one group longer), never more runs than groups. Each run keeps the step's advantages (a
    whitening is over the whole step) and is a loss of its own: its rows' scales are taken over
    its own tokens and rollouts, as each of veRL's mini-batches is. One run: ``step`` itself."""
    count = max(1, min(mini_batches, len(groups)))
    if count == 1:
        return [step]
    size, longer = divmod(len(groups), count)
    updates = []
    first = 0
    for run in range(count):
        last = first + size + (run < longer)
        chosen = [k for k, source in enumerate(step.sources) if first <= source < last]
        rollouts = sum(len(g.rollouts) for g in groups[first:last])
        rewards = tuple(r.reward for g in groups[first:last] for r in g.rollouts)
        scaled = _scaled([step.by_group[k] for k in chosen], rollouts, objective)  # the step's advantages kept
        sources = tuple(step.sources[k] for k in chosen)
        updates.append(StepRows(scaled, rewards, last - first, last - first - len(chosen), sources))
        first = last
    return updates


def _whitened(by_group: Sequence[Sequence[Row]]) -> list[list[Row]]:
    """The rows with their advantages whitened over the step's trained tokens (``reinforce++-baseline``)."""
    flat = [r for g in by_group for r in g]
    values = iter(whiten([r.advantage for r in flat], [r.trained for r in flat]))
    return [[replace(r, advantage=next(values)) for r in g] for g in by_group]


def _scaled(by_group: Sequence[Sequence[Row]], rollouts: int, objective: Objective) -> tuple[tuple[Row, ...], ...]:
    """The rows with their loss scales over ``rollouts`` and their own tokens (:func:`row_scales`)."""
    scales = iter(row_scales([r.trained for g in by_group for r in g], rollouts, objective))
    return tuple(tuple(replace(r, scale=next(scales)) for r in g) for g in by_group)


def split_rows(step: StepRows, ranks: int) -> list[list[Row]]:
    """Whole groups to ranks (:func:`split_groups`), each rank's rows in its groups' order."""
    return [[r for i in share for r in step.by_group[i]] for share in split_groups(step.by_group, ranks)]


def split_groups(by_group: Sequence[Sequence[Row]], ranks: int) -> list[list[int]]:
    """Whole groups to ranks (their indices), the group with the most tokens first to the rank
    with the fewest so far (ties: the lowest rank). Deterministic: the same step always splits
    the same way."""
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    shares: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    order = sorted(range(len(by_group)), key=lambda i: (-sum(len(r.completion_ids) for r in by_group[i]), i))
    for i in order:
        rank = min(range(ranks), key=lambda k: (load[k], k))
        shares[rank].append(i)
        load[rank] += sum(len(r.completion_ids) for r in by_group[i])
    return shares


def plan_micro_batches(
    rows: Sequence[Row], max_rows: int, max_tokens: int | None, packed: bool = False
) -> list[list[Row]]:
    """``rows`` in micro-batches: longest first (so rows of like length pad each other), each
    batch at most ``max_rows`` rows and, padded to its longest row, at most ``max_tokens`` tokens
    (a row longer than that goes alone). ``packed``: the tokens are those of the batch's rows
    packed (:func:`pack`, :func:`pack_width`).
    Deterministic: equal lengths keep their order."""
    order = sorted(range(len(rows)), key=lambda i: (-_length(rows[i]), i))
    batches: list[list[Row]] = []
    for i in order:
        row = rows[i]
        if batches:
            batch = batches[-1]
            if len(batch) < max_rows and (max_tokens is None or _tokens([*batch, row], packed) <= max_tokens):
                batch.append(row)
                continue
        batches.append([row])
    return batches


def pack(lengths: Sequence[int], capacity: int, *, even: bool = True) -> list[list[int]]:
    """Sequences of ``lengths`` in as few rows as ``capacity`` positions a row allow on average,
    balanced: longest first, each in the row least filled so far (the first of equals), then with
    ``even`` the fullest row narrowed by moves and swaps (:func:`_evened`). A row's fill may pass
    ``capacity`` by less than one sequence; the rows come out about as full as each other, so a
    micro-batch as wide as its fullest row has little padding. Deterministic."""
    count = max(1, -(-sum(lengths) // capacity))
    rows: list[list[int]] = [[] for _ in range(count)]
    fill = [0] * count
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        at = min(range(count), key=lambda r: (fill[r], r))
        rows[at].append(i)
        fill[at] += lengths[i]
    rows = [r for r in rows if r]
    return _evened(rows, lengths) if even else rows


def _evened(rows: list[list[int]], lengths: Sequence[int]) -> list[list[int]]:
    """``rows`` with their fullest row narrowed while one change can: a sequence of it moved to
    another row, or swapped for a shorter one, whichever leaves the two rows' wider one the
    narrowest, and only where that is narrower than the fullest row was. Longest-first packing
    leaves its last rows a long sequence apart (8 rollouts of 200 to 509 tokens: rows of 733,
    916 and 919 positions); this evens them (850, 855, 863). Each change narrows the fullest row
    and leaves the other below its old width, so it ends; the bound is a guard."""
    rows = [list(r) for r in rows]
    fill = [sum(lengths[i] for i in r) for r in rows]
    for _ in range(len(lengths) ** 2):
        top = max(range(len(rows)), key=lambda k: (fill[k], -k))
        best: tuple[int, int, int | None, int] | None = None
        for other in range(len(rows)):
            if other == top:
                continue
            for a in rows[top]:
                for b in [None, *rows[other]]:
                    shift = lengths[a] - (lengths[b] if b is not None else 0)
                    wider = max(fill[top] - shift, fill[other] + shift)
                    if shift > 0 and wider < fill[top] and (best is None or wider < best[0]):
                        best = (wider, a, b, other)
        if best is None:
            break
        _, a, b, other = best
        rows[top].remove(a)
        rows[other].append(a)
        if b is not None:
            rows[other].remove(b)
            rows[top].append(b)
        fill[top], fill[other] = sum(lengths[i] for i in rows[top]), sum(lengths[i] for i in rows[other])
    return rows


PACK_FACTOR = 2
"""A packed row is at most this many times as wide as its micro-batch's longest rollout. SDPA (on
CPUs) computes a row's attention densely, at its width squared: rows twice the longest rollout's
width leave a few percent of padding once balanced (:func:`pack`), at about the padded batch's
attention cost, where much wider rows would multiply it for short rollouts. Flash-attention's
varlen kernel (GPUs) computes each rollout's attention alone, whatever the width."""


def pack_width(lengths: Sequence[int]) -> int:
    """The widest a packed row of sequences of ``lengths`` may be."""
    return PACK_FACTOR * max(lengths)


PACK_MIN_SAVING = 0.1
"""A micro-batch is packed only where that computes at least this share fewer positions: its
rows are wider, so each position's attention costs more (densely computed, as SDPA does), and
rows of like length, as the plan puts together, pad little to begin with."""


def micro_batch_rows(lengths: Sequence[int], packed: bool, *, even: bool = True) -> list[list[int]]:
    """The rows a micro-batch of sequences of ``lengths`` computes, each a list of sequences:
    one a row, or with ``packed`` the packed rows (:func:`pack`) where they compute
    :data:`PACK_MIN_SAVING` fewer positions. ``even: False``: the packing before it is evened,
    never narrower (the plan's bound, :func:`plan_micro_batches`)."""
    single = [[i] for i in range(len(lengths))]
    if not packed:
        return single
    rows = pack(lengths, pack_width(lengths), even=even)
    return rows if _positions(rows, lengths) <= (1 - PACK_MIN_SAVING) * _positions(single, lengths) else single


def _positions(rows: Sequence[Sequence[int]], lengths: Sequence[int]) -> int:
    """Rows times the fullest row's width."""
    return len(rows) * max(sum(lengths[i] for i in row) for row in rows)


def _tokens(batch: Sequence[Row], packed: bool) -> int:
    """The positions a micro-batch of ``batch`` computes at most: packed, those of its packing
    before it is evened (the plan asks once a row it adds; evening only narrows)."""
    lengths = [_length(r) for r in batch]
    return _positions(micro_batch_rows(lengths, packed, even=False), lengths)


def _length(row: Row) -> int:
    return len(row.prompt_ids) + len(row.completion_ids)


def micro_batches(shares: Sequence[Sequence[Row]], max_rows: int, max_tokens: int | None, packed: bool = False) -> int:
    """Forward/backward passes every rank runs: the most any rank's share needs."""
    return max((len(plan_micro_batches(s, max_rows, max_tokens, packed)) for s in shares), default=0)


@dataclass
class LossSums:
    """Sums over trained tokens (a rank's, or the step's once the ranks' are added); fields named
    ``*_max`` are maxima."""

    loss: float = 0.0
    policy: float = 0.0
    kl: float = 0.0
    clipped: int = 0
    ratio: float = 0.0
    ratio_max: float = 0.0
    is_weight: float = 0.0
    is_weight_max: float = 0.0
    is_capped: int = 0
    probs_diff: float = 0.0
    probs_diff_max: float = 0.0
    probs_diff_tokens: int = 0
    stale_diff: float = 0.0
    stale_diff_max: float = 0.0
    stale_diff_tokens: int = 0
    entropy: float = 0.0
    outside_nucleus: int = 0
    """Trained tokens outside the trainer's top-p nucleus, left out of the loss."""
    padded_tokens: int = 0
    """Positions the micro-batches computed (rows times their padded width)."""
    real_tokens: int = 0
    """Of those, the rows' own prompt and completion tokens."""

    def add(self, terms: Any, padded_tokens: int = 0, real_tokens: int = 0) -> None:
        """Adds one micro-batch's :class:`~spotrl_runtime.training.losses.LossTerms`."""
        self.merge(
            LossSums(
                loss=float(terms.loss_sum.detach()),
                policy=terms.policy_sum,
                kl=terms.kl_sum,
                clipped=terms.clipped_tokens,
                ratio=terms.ratio_sum,
                ratio_max=terms.ratio_max,
                is_weight=terms.is_weight_sum,
                is_weight_max=terms.is_weight_max,
                is_capped=terms.is_capped,
                probs_diff=terms.probs_diff_sum,
                probs_diff_max=terms.probs_diff_max,
                probs_diff_tokens=terms.probs_diff_tokens,
                stale_diff=terms.stale_diff_sum,
                stale_diff_max=terms.stale_diff_max,
                stale_diff_tokens=terms.stale_diff_tokens,
                entropy=terms.entropy_sum,
                outside_nucleus=terms.outside_nucleus,
                padded_tokens=padded_tokens,
                real_tokens=real_tokens,
            )
        )

    def merge(self, other: LossSums) -> None:
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            setattr(self, f.name, max(mine, theirs) if f.name.endswith("_max") else mine + theirs)

    @classmethod
    def total(cls, parts: Sequence[LossSums]) -> LossSums:
        out = cls()
        for p in parts:
            out.merge(p)
        return out


ROLLOUT_GAP_METRICS = ("rollout_probs_diff_mean", "rollout_probs_diff_max", "rollout_probs_diff_tokens")
STALE_GAP_METRICS = (
    "rollout_probs_diff_stale_mean",
    "rollout_probs_diff_stale_max",
    "rollout_probs_diff_stale_tokens",
)
"""The step metrics that compare the generator's log-probs with the trainer's (:func:`step_metrics`)."""


def step_metrics(step: StepRows, sums: LossSums, epochs: int = 1) -> dict[str, float]:
    """The step's loss metrics (token means), the same for one process and for a group of ranks.

    ``rollout_probs_diff_mean``/``_max`` (veRL's names; NeMo-RL's ``token_mult_prob_error`` and
    TRL's ``sampling_logp_difference`` measure the same thing) compare the generator's
    probability of each trained token with the trainer's, over the rows generated with the
    weights the step started from; they are left out when no such row was trained (every
    group of the step was generated ahead, with older weights, or had equal rewards).
    ``rollout_probs_diff_stale_*`` are the same over rows generated with older weights.
    ``is_weight_mean``/``_max`` and ``is_capped_fraction`` describe the importance weight
    (:func:`~spotrl_runtime.training.losses.importance_weight`) over every trained token;
    ``outside_nucleus_fraction`` is the share of trained tokens outside the trainer's top-p
    nucleus, which the loss leaves out (0 at ``topP: 1``; a share far above the numerics' edge
    cases is what ``rollout_probs_diff_*`` shows too, as the generator's probability of them);
    ``padding_share`` is the share of the positions computed that were padding.

    With ``epochs`` passes over the step's rows (``training.epochs``), ``sums`` holds every
    pass's: the token means are over every token of every pass."""
    tokens = step.tokens
    denom = max(tokens, 1) * epochs
    gap: dict[str, float] = {}
    if sums.probs_diff_tokens:
        values = (sums.probs_diff / sums.probs_diff_tokens, sums.probs_diff_max, float(sums.probs_diff_tokens))
        gap = dict(zip(ROLLOUT_GAP_METRICS, values, strict=True))
    if sums.stale_diff_tokens:
        values = (sums.stale_diff / sums.stale_diff_tokens, sums.stale_diff_max, float(sums.stale_diff_tokens))
        gap |= dict(zip(STALE_GAP_METRICS, values, strict=True))
    return (
        gap
        | (step.overlong or {})
        | {
            "reward_mean": sum(step.rewards) / len(step.rewards) if step.rewards else 0.0,
            "groups": float(step.groups),
            "groups_zero_variance": float(step.skipped),
            "rollouts": float(len(step.rewards)),
            "tokens": float(tokens),
            "loss": sums.loss / denom,
            "policy_loss": sums.policy / denom,
            "kl": sums.kl / denom,
            "entropy": sums.entropy / denom,
            "clip_fraction": sums.clipped / denom,
            "ratio_mean": sums.ratio / denom if tokens else 1.0,
            "ratio_max": sums.ratio_max,
            "is_weight_mean": sums.is_weight / denom if tokens else 1.0,
            "is_weight_max": sums.is_weight_max,
            "is_capped_fraction": sums.is_capped / denom,
            "outside_nucleus_fraction": sums.outside_nucleus / denom,
            "padding_share": 1.0 - sums.real_tokens / sums.padded_tokens if sums.padded_tokens else 0.0,
        }
        | (step.reward_kl or {})  # the KL in the reward: ``kl`` is the scoring pass's, the loss has none
    )
