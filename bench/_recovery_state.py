"""Shared by the recovery benchmarks: a run with many groups in flight, and small table printing."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from spotrl_runtime.core.owners import Dispatch, Owners, RecoveryConfig
from spotrl_runtime.core.types import Rollout
from spotrl_runtime.data import ArithmeticDataset, PromptCollate
from spotrl_runtime.data.loader import PromptLoader

GROUPS = 10_000
BATCH = 100
GROUP_SIZE = 4
COMPLETION_TOKENS = 32


def rollout(d: Dispatch, index: int) -> Rollout:
    prompt = tuple(range(100, 100 + 2 * len(d.prompt.text)))
    return Rollout(
        d.group_id,
        index,
        prompt,
        tuple(range(1000, 1000 + COMPLETION_TOKENS)),
        tuple(-0.5 - 0.001 * k for k in range(COMPLETION_TOKENS)),
        float(index % 2),
        d.weight_version,
        "x" * COMPLETION_TOKENS,
        "stop",
    )


def busy_owners(finished: int) -> tuple[Owners, ArithmeticDataset, RecoveryConfig]:
    """GROUPS groups admitted (lookahead wide open); the first ``finished`` moved to the replay buffer."""
    config = RecoveryConfig(group_size=GROUP_SIZE, prompts_per_step=BATCH, lookahead=GROUPS // BATCH - 1)
    dataset = ArithmeticDataset(size=4 * GROUPS)
    owners = Owners(config, PromptLoader(dataset, PromptCollate(), batch_size=BATCH, shuffle=True, seed=1))
    sent = owners.pump()
    assert len(sent) == GROUPS, len(sent)
    for d in sent[:finished]:
        owners.finish_group(d.group_id, [rollout(d, i) for i in d.rollout_indexes])
    return owners, dataset, config


def timed(fn: Callable[[], Any], repeat: int = 5) -> tuple[float, Any]:
    """Median seconds of ``repeat`` calls, and the last result."""
    times = []
    result = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def table(title: str, header: tuple[str, ...], rows: list[tuple[Any, ...]]) -> None:
    """Prints a small Markdown table."""
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
