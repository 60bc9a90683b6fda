"""Validation during training: the held-out split (``spec.validation``) scored by the
generation workers, with the job's prompt format and reward, on the weights of every Nth step.

A pass is generation work like any other for the pool (each request asks for the version it
scores, so it is generated with exactly those weights), except that its requests yield: the pool
runs a pass on one worker and, where another worker can load the next version, leaves that one
out of the sync until the pass is done (it is given the version after), so a pass does not delay
a sync. It belongs to no ledger: the recovery state never sees a validation group, a cut never
holds one, and a barrier abandons a pass in flight instead of waiting for it. The next version
due is scored after a resume.

Everything here runs on the dispatcher thread (which also scores the training groups); a
finished pass is handed to the trainer thread for the next step's record.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from spotrl_runtime.generation.evaluate import EvalResult, eval_requests
from spotrl_runtime.generation.types import GenerationRequest, GroupFailed, GroupLost, GroupOutcome

log = logging.getLogger("spotrl.controller")

PREFIX = "val-"
"""Every validation group's id starts with it (a training group's never does)."""


@dataclass
class _Pass:
    version: int
    requests: dict[str, GenerationRequest]
    prompts: dict[str, Any]
    started: float
    result: EvalResult = field(default_factory=EvalResult)
    left: set[str] = field(default_factory=set)


class Validator:
    """Starts a pass when a version due is given to the pool; collects and scores its groups."""

    def __init__(self, spec: Any, encode: Any, reward: Any) -> None:
        from spotrl_runtime.data import collate_for, open_dataset

        v = spec.validation
        dataset_spec = spec.validation_dataset()
        dataset, collate = open_dataset(dataset_spec), collate_for(dataset_spec)
        self.prompts = [collate(dataset[i]) for i in range(min(len(dataset), v.limit))]
        self.spec, self.encode, self.reward = spec, encode, reward
        self.every, self.samples = v.every_steps, v.samples
        self._pass: _Pass | None = None
        self._scored = -1
        """The newest version a pass was started for."""
        self._done: list[dict[str, float]] = []
        self._lock = threading.Lock()

    @staticmethod
    def owns(group_id: str) -> bool:
        return group_id.startswith(PREFIX)

    def due(self, version: int) -> list[GenerationRequest]:
        """The requests of a pass over ``version``'s weights, if it is due (a multiple of
        ``everySteps``, newer than the last, and no pass in flight); else none."""
        if version % self.every or version <= self._scored or self._pass is not None or not self.prompts:
            return []
        self._scored = version
        made = eval_requests(
            self.prompts,
            self.encode,
            self.spec,
            samples=self.samples,
            temperature=self.spec.generation.temperature,
            prefix=f"{PREFIX}{version}",
        )
        # Yielding: where another worker can load the next version, the one running the pass
        # is left out of that sync and finishes it on ``version``'s weights (the pool's "behind").
        requests = [replace(r, weight_version=version, yields=True) for r in made]
        self._pass = _Pass(
            version,
            {r.group_id: r for r in requests},
            {r.group_id: p for r, p in zip(requests, self.prompts, strict=True)},
            time.monotonic(),
            left={r.group_id for r in requests},
        )
        return requests

    def take(self, outcome: GroupOutcome) -> list[GenerationRequest]:
        """Scores a validation group's outcome; returns what to generate again (a lost group)."""
        p = self._pass
        if p is None or outcome.group_id not in p.left:
            return []  # a pass abandoned, or a late duplicate
        if isinstance(outcome, GroupLost):
            return [p.requests[outcome.group_id]]
        p.left.discard(outcome.group_id)
        prompt = p.prompts[outcome.group_id]
        if isinstance(outcome, GroupFailed):
            p.result.prompts += 1
            p.result.completions += self.samples
            p.result.failed += self.samples
        else:
            texts = [s.text for s in outcome.samples]
            p.result.add(prompt, outcome, self.reward.score(prompt, texts, stop_at_failure=False), examples=0)
        if not p.left:
            self._finish(p)
        return []

    def abandon(self) -> None:
        """Drops the pass in flight (a barrier: its groups are never waited for)."""
        self._pass = None

    def finished(self) -> list[dict[str, float]]:
        """The passes finished since the last call, for the trainer thread's next record."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def _finish(self, p: _Pass) -> None:
        summary = p.result.summary()
        record = {
            "val_step": float(p.version),
            "val_accuracy": round(float(summary["accuracy"]), 6),
            "val_reward": round(float(summary["reward_mean"]), 6),
            "val_prompts": float(summary["prompts"]),
            "val_reward_failed": float(summary["reward_failed"]),
            "val_seconds": round(time.monotonic() - p.started, 3),
        }
        log.info(
            "validation of step %d: accuracy %.3f, reward %.3f over %d prompts (%.1f s)",
            p.version,
            record["val_accuracy"],
            record["val_reward"],
            summary["prompts"],
            record["val_seconds"],
        )
        with self._lock:
            self._done.append(record)
        self._pass = None
